package projection_test

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestPlannerTermsAndFencesAreSkippedQuietly: the planner's leader terms and
// decision fences share FLEET_EVENTS with the domain events; the projection
// passes over them without a warning per message, and still projects the
// fenced decision itself.
func TestPlannerTermsAndFencesAreSkippedQuietly(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	store := bus.NewEventStore(c, events.SourcePlanner, nil)
	term, err := store.ClaimTerm(ctx, "p1", 1)
	if err != nil {
		t.Fatal(err)
	}
	d := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName("demo-aaaaaaaaaa"), Revision: 1, Port: 3128}}
	seq, err := store.AppendFenced(ctx, term, events.AggregateProxy, "demo-aaaaaaaaaa", events.ProxyRequested, "demo-aaaaaaaaaa.requested.1", d, &bus.Expect{Seq: 0})
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	p := projection.New(c, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})), nil)
	for s := uint64(1); s <= seq; s++ {
		m, err := st.GetMsg(ctx, s)
		if err != nil {
			t.Fatalf("message %d: %v", s, err)
		}
		if err := p.Apply(ctx, s, m.Subject, m.Data); err != nil {
			t.Fatalf("apply %d (%s): %v", s, m.Subject, err)
		}
	}
	if logs.Len() != 0 {
		t.Errorf("projection logged warnings for planner messages:\n%s", logs.String())
	}
	kv, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Get(ctx, "demo-aaaaaaaaaa"); err != nil {
		t.Errorf("the fenced decision is not in fleet-proxies: %v", err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for k := range keys.Keys() {
		if k != "demo-aaaaaaaaaa" {
			t.Errorf("fleet-proxies holds %q", k)
		}
	}
}
