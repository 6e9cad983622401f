package bus_test

import (
	"context"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// countRequests counts the requests published on subject on the server
// behind c, seen by a core NATS subscription beside JetStream's own: the
// returned function gives the count of those the server had routed when
// it was called.
func countRequests(t *testing.T, c *bus.Conn, subject string) func() int {
	t.Helper()
	watcher := bustest.Dial(t, c)
	sub, err := watcher.NC.SubscribeSync(subject)
	if err != nil {
		t.Fatalf("subscribe %s: %v", subject, err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := watcher.NC.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
	return func() int {
		t.Helper()
		// The server routes a request to every subscriber when it
		// arrives, before answering it; a round trip on the watcher's
		// connection brings what was routed into the pending queue.
		if err := watcher.NC.Flush(); err != nil {
			t.Fatalf("flush: %v", err)
		}
		n, _, err := sub.Pending()
		if err != nil {
			t.Fatalf("pending on %s: %v", subject, err)
		}
		return n
	}
}

// An agent looks up a proxy's state once per command: each lookup must be
// one direct get as a rule, not a stream-info request before it.
func TestLookupsAskTheStreamInfoOnce(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	infos := countRequests(t, c, "$JS.API.STREAM.INFO."+bus.EventsStream)
	gets := countRequests(t, c, "$JS.API.DIRECT.GET."+bus.EventsStream+".>")

	planner := bus.NewEventStore(bustest.Dial(t, c), "proxyfleet/planner", nil)
	if _, err := planner.Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, &bus.Expect{}); err != nil {
		t.Fatalf("append: %v", err)
	}
	agent := bus.NewEventStore(bustest.Dial(t, c), "proxyfleet/agent", nil)
	by := events.Observer{Entry: "local", Target: "host-a"}
	const lookups = 20
	for i := range lookups {
		last, err := agent.LastSeenBy(ctx, "p1", by)
		if err != nil {
			t.Fatalf("lookup %d: %v", i, err)
		}
		if last == nil || last.Kind != events.ProxyRequested {
			t.Fatalf("lookup %d: got %+v, want the requested event", i, last)
		}
		if _, err := agent.Last(ctx, events.AggregateProxy, "p2"); err != nil {
			t.Fatalf("lookup %d of a proxy with no event: %v", i, err)
		}
	}
	if got, want := gets(), 2*lookups; got != want {
		t.Errorf("direct gets: got %d, want %d (one per LastSeenBy, one per Last)", got, want)
	}
	if got := infos(); got > 1 {
		t.Errorf("stream-info requests for %d lookups: got %d, want at most 1", 2*lookups, got)
	}

	// Another agent's observation after the decision: the agent's own
	// view needs the decisions' and its own last events too.
	other := bus.NewEventStore(bustest.Dial(t, c), events.AgentSource("local", "host-b"), nil)
	if _, err := other.Append(ctx, events.AggregateProxy, "p1", events.ProxyDeleted, "p1.deleted.b", map[string]string{}, nil); err != nil {
		t.Fatalf("append another agent's observation: %v", err)
	}
	before := gets()
	last, err := agent.LastSeenBy(ctx, "p1", by)
	if err != nil || last == nil || last.Kind != events.ProxyRequested {
		t.Fatalf("lookup after another agent's observation: got %+v, %v; want the requested event", last, err)
	}
	if got := gets() - before; got != 3 {
		t.Errorf("direct gets of a lookup after another agent's observation: got %d, want 3 (the last event, then the decisions' and its own)", got)
	}
}

// A store keeps its stream handle, so a stream deleted and created again
// under it (an administrator recreating FLEET_EVENTS) must not leave the
// store failing: the first lookup after the stream is gone fails, and the
// store finds the new stream once it exists.
func TestLookupsFollowARecreatedStream(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "proxyfleet/planner", nil)
	if _, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, &bus.Expect{}); err != nil {
		t.Fatalf("append: %v", err)
	}
	if last, err := s.Last(ctx, events.AggregateProxy, "p1"); err != nil || last == nil {
		t.Fatalf("last before: got %v, %v; want the requested event", last, err)
	}
	if err := c.JS.DeleteStream(ctx, bus.EventsStream); err != nil {
		t.Fatalf("delete stream: %v", err)
	}
	if last, err := s.Last(ctx, events.AggregateProxy, "p1"); err == nil {
		t.Fatalf("last with no stream: got %+v and no error, want an error", last)
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatalf("topology: %v", err)
	}
	if last, err := s.Last(ctx, events.AggregateProxy, "p1"); err != nil || last != nil {
		t.Fatalf("last in the new, empty stream: got %+v, %v; want nil, nil", last, err)
	}
	if _, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.2", map[string]string{}, &bus.Expect{}); err != nil {
		t.Fatalf("append to the new stream: %v", err)
	}
	last, err := s.Last(ctx, events.AggregateProxy, "p1")
	if err != nil || last == nil || last.Envelope.ID != "p1.requested.2" {
		t.Fatalf("last in the new stream: got %+v, %v; want p1.requested.2", last, err)
	}
	var n int
	if err := s.Replay(ctx, 0, func(bus.Event) error { n++; return nil }); err != nil || n != 1 {
		t.Fatalf("replay of the new stream: got %d events, %v; want 1", n, err)
	}
}
