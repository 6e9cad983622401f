package bus_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
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

// TestEventsWithATTLAreNeverActedOn: the stream allows per-message TTLs
// for the planner's fences, and the server lets any writer set one. An
// event that carries a Nats-TTL is not history: readers skip it as
// unreadable (a lookup answers the event before it), so its expiry
// changes no view, and a read whose end was such an event, expired before
// it was read, still ends instead of waiting for it.
func TestEventsWithATTLAreNeverActedOn(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Second)
	c := bustest.Start(t)
	health := bus.NewEventStore(c, events.SourceHealth, nil)
	ready, err := health.Append(ctx, events.AggregateProxy, "p1", events.ProxyReady, "p1.ready.1", events.ProxyReadyData{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// A writer's unhealthy that would expire after a second.
	subject := events.EventSubject(events.AggregateProxy, "p1", events.ProxyUnhealthy)
	env, err := events.NewEnvelope("p1.unhealthy.1", events.SourceHealth, events.EnvelopeType(events.AggregateProxy, events.ProxyUnhealthy), "p1", time.Now(),
		events.ProxyUnhealthyData{Reason: "gone in a second", Streak: 3})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := env.MarshalJSON()
	msg := nats.NewMsg(subject)
	msg.Data = body
	msg.Header.Set(jetstream.MsgTTLHeader, "1s")
	ack, err := c.JS.PublishMsg(ctx, msg)
	if err != nil {
		t.Fatal(err)
	}

	if last, err := health.Last(ctx, events.AggregateProxy, "p1"); err != nil || last == nil || last.Seq != ready {
		t.Fatalf("Last: %+v (%v), want the ready at %d, not the event with a TTL", last, err, ready)
	}
	evs, err := health.Load(ctx, events.AggregateProxy, "p1")
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].Unreadable != nil || evs[1].Seq != ack.Sequence || evs[1].Unreadable == nil ||
		!strings.Contains(evs[1].Unreadable.Error(), "only the planner's fences may expire") {
		t.Fatalf("Load: %+v; want the ready, then the event with a TTL as unreadable", evs)
	}

	// A read that learned its end (the event with the TTL) before the
	// event expired, and reads after, still ends.
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	bus.SetReadEndHook(t, func() {
		testwait.Until(t, 10*time.Second, "the event with a TTL to expire", func() bool {
			_, err := st.GetMsg(ctx, ack.Sequence)
			return errors.Is(err, jetstream.ErrMsgNotFound)
		})
	}, 200*time.Millisecond)
	var read []uint64
	if err := health.Replay(ctx, 0, func(e bus.Event) error {
		read = append(read, e.Seq)
		return nil
	}); err != nil {
		t.Fatalf("Replay after its end expired: %v", err)
	}
	if len(read) != 1 || read[0] != ready {
		t.Errorf("Replay read %v; want only the ready at %d", read, ready)
	}
}
