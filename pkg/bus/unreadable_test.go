package bus_test

import (
	"context"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// TestUnreadableEventsAreSkippedNotBlocking: a message whose envelope
// does not decode (0 bytes, as any writer allowed on the subject may
// publish) is delivered by a read with Unreadable set and its position,
// and never answers a lookup of the last event: the last one that reads
// does, so an agent's delete of a retiring proxy is not stuck on it.
func TestUnreadableEventsAreSkippedNotBlocking(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	planner := bus.NewEventStore(c, events.SourcePlanner, nil)
	retiring, err := planner.Append(ctx, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.1", events.ProxyRetiringData{Reason: "test"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	by := events.Observer{Entry: "local", Target: "t1"}
	for _, subject := range []string{
		events.EventSubject(events.AggregateProxy, "p1", events.ProxyDeleted),
		events.ObservationSubject("p1", events.ProxyDeleted, by.Entry, by.Target),
	} {
		if _, err := c.JS.Publish(ctx, subject, nil); err != nil {
			t.Fatal(err)
		}
	}
	agent := bus.NewEventStore(c, by.Source(), nil)
	last, err := agent.LastSeenBy(ctx, "p1", by)
	if err != nil || last == nil || last.Seq != retiring || last.Kind != events.ProxyRetiring {
		t.Fatalf("LastSeenBy: %+v (%v), want the retiring at %d", last, err, retiring)
	}
	if last, err := agent.Last(ctx, events.AggregateProxy, "p1"); err != nil || last == nil || last.Seq != retiring {
		t.Errorf("Last: %+v (%v), want the retiring at %d", last, err, retiring)
	}
	evs, err := agent.Load(ctx, events.AggregateProxy, "p1")
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 3 || evs[0].Unreadable != nil {
		t.Fatalf("Load: %d events, want the retiring and two unreadable", len(evs))
	}
	for _, e := range evs[1:] {
		if e.Unreadable == nil || e.ID != "p1" || e.Kind != events.ProxyDeleted || e.Seq <= retiring || e.Envelope.ID != "" {
			t.Errorf("Load: %+v, want an unreadable deleted of p1 after %d with an empty envelope", e, retiring)
		}
	}
}
