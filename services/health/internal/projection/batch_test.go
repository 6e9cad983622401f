package projection_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/projection"
)

// TestBatchesGiveTheViewsOfOneEventAtATime applies a log of thousands of
// mixed events one event at a time, each by a new projector that reads
// what it needs from the buckets and writes before the next event starts,
// and then, on another server holding the same log, in batches: with
// random boundaries; with crashes in the middle of a batch's writes or
// between its writes and its acknowledgement, each followed by a
// redelivery; by Replay; and by the live consumer, crashing twice. Every
// key of both views must hold the same bytes every time.
func TestBatchesGiveTheViewsOfOneEventAtATime(t *testing.T) {
	msgs := mixedLog(3, 3000)
	raws := make([]projection.Raw, len(msgs))
	for i, m := range msgs {
		raws[i] = projection.Raw{Seq: uint64(i + 1), Subject: m.subject, Data: m.data}
	}

	// About 9,000 events applied one at a time, each by a new projector
	// with its own KV reads and writes, then the same log six more ways.
	ref := openFor(t, 5*time.Minute)
	if last := publishLog(t, ref.ctx, ref.conn, msgs); last != uint64(len(msgs)) {
		t.Fatalf("log ends at %d; want %d", last, len(msgs))
	}
	for _, r := range raws {
		if err := projection.New(ref.conn, nil, nil).Apply(ref.ctx, r.Seq, r.Subject, r.Data); err != nil {
			t.Fatalf("apply %d: %v", r.Seq, err)
		}
	}
	want := ref.dump()
	checkVariety(t, want)

	e := openFor(t, 5*time.Minute)
	if last := publishLog(t, e.ctx, e.conn, msgs); last != uint64(len(msgs)) {
		t.Fatalf("log ends at %d; want %d", last, len(msgs))
	}
	r := rand.New(rand.NewPCG(11, 13))
	rebuild := func() {
		t.Helper()
		if err := projection.Rebuild(e.ctx, e.conn); err != nil {
			t.Fatal(err)
		}
	}
	same := func(what string) {
		t.Helper()
		got := e.dump()
		if len(got) != len(want) {
			t.Errorf("%s: views hold %d keys; want %d", what, len(got), len(want))
		}
		diffDumps(t, got, want)
	}

	p := projection.New(e.conn, nil, nil)
	for i := 0; i < len(raws); {
		k := min(1+r.IntN(700), len(raws)-i)
		if err := p.ApplyBatch(e.ctx, raws[i:i+k]); err != nil {
			t.Fatalf("batch at %d: %v", raws[i].Seq, err)
		}
		i += k
	}
	same("random batches")

	rebuild()
	crashes := 0
	for i := 0; i < len(raws); {
		k := min(1+r.IntN(700), len(raws)-i)
		p := projection.New(e.conn, nil, nil)
		if r.IntN(2) == 0 {
			// Writes of earlier waves land, a random half of one wave's
			// writes land, none after; or all land and the acks do not.
			wave := r.IntN(4)
			p.SetCrash(func(w int, _, _ string) bool {
				switch {
				case w < 0:
					return wave == 3
				case w < wave:
					return false
				case w == wave:
					return r.IntN(2) == 0
				}
				return true
			})
		}
		err := p.ApplyBatch(e.ctx, raws[i:i+k])
		switch {
		case errors.Is(err, projection.ErrCrashed):
			// Redelivery from the first unacknowledged event, by the
			// next process, in a batch of its own size.
			crashes++
			k = min(1+r.IntN(700), len(raws)-i)
			if err := projection.New(e.conn, nil, nil).ApplyBatch(e.ctx, raws[i:i+k]); err != nil {
				t.Fatalf("redelivered batch at %d: %v", raws[i].Seq, err)
			}
		case err != nil:
			t.Fatalf("batch at %d: %v", raws[i].Seq, err)
		}
		i += k
	}
	if crashes < 3 {
		t.Fatalf("only %d batches crashed", crashes)
	}
	same("batches with crashes and redeliveries")

	if err := projection.Replay(e.ctx, e.conn, nil); err != nil {
		t.Fatal(err)
	}
	same("replay")

	// A replay whose batches lose writes, or fail once all are made, reads
	// their events again from the batch's first one. Small batches put the
	// failures in the middle of the log.
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")
	p = projection.New(e.conn, nil, &telemetry.Telemetry{Tracer: tracenoop.NewTracerProvider().Tracer(""), Meter: meter})
	p.SetReplayKeys(40)
	written, dropped, failed := 0, 0, 0
	p.SetCrash(func(w int, _, _ string) bool {
		switch {
		case w < 0:
			written++
			if written == 12 || written == 20 {
				failed++
				return true
			}
		case written >= 5 && dropped < 30 && r.IntN(2) == 0:
			dropped++
			return true
		}
		return false
	})
	if err := projection.ReplayWith(e.ctx, p); err != nil {
		t.Fatal(err)
	}
	if dropped < 30 || failed < 2 {
		t.Fatalf("the replay dropped %d writes and failed %d batches; want 30 and 2", dropped, failed)
	}
	if n := appliedEvents(t, reader); n != int64(len(msgs)) {
		t.Errorf("the replay counted %d events applied; want every event once: %d", n, len(msgs))
	}
	same("replay with failed writes")

	// The live consumer: a crash while the second batch is written, then
	// one before the next projector acknowledges its first batch. A crash
	// leaves the consumer pinned to the dead projector for a while;
	// unpinning stands in for that wait.
	rebuild()
	crashRun := func(crashAt func(batch, wave int) bool) {
		t.Helper()
		p := projection.New(e.conn, nil, nil)
		batch := 1
		p.SetCrash(func(w int, _, key string) bool {
			crash := crashAt(batch, w) && (w < 0 || strings.HasSuffix(key, "1") || strings.HasSuffix(key, "5"))
			if w < 0 {
				batch++
			}
			return crash
		})
		if err := p.Run(e.ctx); !errors.Is(err, projection.ErrCrashed) {
			t.Fatalf("projector: got %v, want the simulated crash", err)
		}
		st, err := e.conn.JS.Stream(e.ctx, bus.EventsStream)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.UnpinConsumer(e.ctx, projection.ConsumerName, projection.PriorityGroup); err != nil {
			t.Fatal(err)
		}
	}
	crashRun(func(batch, wave int) bool { return batch == 2 || batch > 2 && wave < 0 })
	crashRun(func(batch, wave int) bool { return batch == 1 && wave < 0 })
	e.run()
	e.caughtUp()
	same("live consumer after two crashes")
}

// checkVariety fails unless views hold what the log is meant to exercise:
// many proxies in several states, replacements noted, pools.
func checkVariety(t *testing.T, views map[string][]byte) {
	t.Helper()
	states, noted, pools := map[string]int{}, 0, 0
	for k, v := range views {
		if strings.HasPrefix(k, bus.BucketPools+"/") {
			pools++
			continue
		}
		for _, s := range events.ProxyStates() {
			if strings.Contains(string(v), `"state":"`+s+`"`) {
				states[s]++
			}
		}
		if strings.Contains(string(v), `"replacedBy"`) {
			noted++
		}
	}
	if len(states) < 6 || noted < 10 || pools < 2 {
		t.Fatalf("views hold proxies in states %v, %d noted replacements, %d pools; the log is not varied enough", states, noted, pools)
	}
}

// TestTwoProjectorsTakeTurns runs two projectors on one consumer while the
// log is appended, as two health instances would, and stops the one
// holding the consumer halfway: the views must be those a rebuild gives.
func TestTwoProjectorsTakeTurns(t *testing.T) {
	e := open(t)
	msgs := mixedLog(5, 2000)
	type runner struct {
		stop func()
		done chan error
	}
	start := func() runner {
		ctx, cancel := context.WithCancel(e.ctx)
		r := runner{stop: cancel, done: make(chan error, 1)}
		go func() { r.done <- projection.New(e.conn, nil, nil).Run(ctx) }()
		return r
	}
	a, b := start(), start()
	defer func() {
		for _, r := range []runner{a, b} {
			r.stop()
			if err := <-r.done; err != nil {
				t.Errorf("projector: %v", err)
			}
		}
	}()
	half := len(msgs) / 2
	publishLog(t, e.ctx, e.conn, msgs[:half])
	// Stop the one holding the consumer; the other takes over at once.
	cons, err := e.conn.JS.Consumer(e.ctx, bus.EventsStream, projection.ConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	pinned := func() string {
		info, err := cons.Info(e.ctx)
		if err != nil || len(info.PriorityGroups) != 1 {
			t.Fatalf("consumer info: %v", err)
		}
		return info.PriorityGroups[0].PinnedClientID
	}
	e.caughtUp()
	holder := pinned()
	if holder == "" {
		t.Fatal("no projector holds the consumer after applying events")
	}
	restart := func(r *runner) {
		r.stop()
		if err := <-r.done; err != nil {
			t.Fatalf("projector: %v", err)
		}
		*r = start()
	}
	restart(&a)
	if pinned() == holder {
		restart(&b) // a did not hold it
	}
	if got := pinned(); got == holder {
		t.Fatalf("the consumer is still pinned to the stopped projector (%s)", got)
	}
	publishLog(t, e.ctx, e.conn, msgs[half:])
	e.caughtUp()
	live := e.dump()
	checkVariety(t, live)

	if err := projection.Replay(e.ctx, e.conn, nil); err != nil {
		t.Fatal(err)
	}
	diffDumps(t, e.dump(), live)
}

// appliedEvents sums the projection's events metric over its aggregates.
func appliedEvents(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "proxyfleet_health_projection_events_total" {
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}
