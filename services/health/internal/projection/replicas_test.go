package projection_test

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/projection"
)

// TestTwoReplicasNeverBothApply runs the projectors of two health replicas,
// each on its own connection as two processes would, while the log grows in
// rounds: the consumer is pinned to one of them, so every event is applied
// by that one, and the other applies nothing. Without the pin both would
// take deliveries and apply events, each writing the views. An event may
// be read twice by the pinned one: each reset (when it gets the pin, or
// after a gap in its deliveries) delivers again from the acknowledgement
// floor, and what was applied already changes nothing (each key's seq);
// the views equal a replay at the end.
func TestTwoReplicasNeverBothApply(t *testing.T) {
	e := open(t)
	conns := []*bus.Conn{e.conn, bustest.Dial(t, e.conn)}
	readers := make([]*sdkmetric.ManualReader, len(conns))
	for i, c := range conns {
		readers[i] = sdkmetric.NewManualReader()
		meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(readers[i])).Meter("test")
		p := projection.New(c, nil, &telemetry.Telemetry{Tracer: tracenoop.NewTracerProvider().Tracer(""), Meter: meter})
		ctx, cancel := context.WithCancel(e.ctx)
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("projector %d: %v", i, err)
			}
		})
	}
	msgs := mixedLog(11, 1200)
	const rounds = 6
	per := len(msgs) / rounds
	for r := range rounds {
		publishLog(t, e.ctx, e.conn, msgs[r*per:(r+1)*per])
		e.caughtUp()
		a, b := appliedEvents(t, readers[0]), appliedEvents(t, readers[1])
		if a != 0 && b != 0 {
			t.Fatalf("round %d: both replicas applied events (%d and %d)", r, a, b)
		}
		if want := int64((r + 1) * per); a+b < want {
			t.Fatalf("round %d: %d events applied, want each of the %d appended at least once", r, a+b, want)
		}
	}
	live := e.dump()
	if err := projection.Replay(e.ctx, e.conn, nil); err != nil {
		t.Fatal(err)
	}
	diffDumps(t, e.dump(), live)
}
