package bus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// BenchmarkAppend measures appending one event to FLEET_EVENTS: the
// baseline is a bare JetStream publish with a Msg-Id of a payload of the same
// size; "observation" is EventStore.Append (envelope, trace headers,
// Msg-Id); "decision" adds the expected last sequence of the aggregate's
// wildcard, as API handlers append operator intent; "fenced" is the
// reconciler's decision (EventStore.AppendFenced: an atomic batch of a fence
// message checked against the leader's term and the decision). `make bench`
// prints each as a ratio of the baseline.
func BenchmarkAppend(b *testing.B) {
	ctx := context.Background()
	c := bustest.Start(b)
	s := bus.NewEventStore(c, "bench", nil)
	data := events.ProxyRunningData{Address: "127.0.0.1:20000", Attempt: 1, ProviderID: "px-aaaaaaaaaaaaaaaa"}
	env, _ := events.NewEnvelope("x.running.1", "bench", events.EnvelopeType("proxy", "running"), "x", time.Now(), data)
	raw, _ := env.MarshalJSON()

	b.Run("baseline", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("base-%d", i)
			if _, err := c.JS.Publish(ctx, events.EventSubject(events.AggregateProxy, id, events.ProxyRunning), raw, jetstream.WithMsgID(id)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("observation", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("obs-%d", i)
			if _, err := s.Append(ctx, events.AggregateProxy, id, events.ProxyRunning, id+".running.1", data, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	benchDecisions(ctx, b, s, data)
}

// benchDecisions measures decisions (appends expecting the aggregate's last
// sequence) and fenced decisions (the same, checked against a leader term
// too) on store s.
func benchDecisions(ctx context.Context, b *testing.B, s *bus.EventStore, data any) {
	b.Run("decision", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("dec-%d", i)
			if _, err := s.Append(ctx, events.AggregateProxy, id, events.ProxyRunning, id+".running.1", data, &bus.Expect{Seq: 0}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("fenced", func(b *testing.B) {
		term, err := s.ClaimTerm(ctx, "bench", 1)
		if err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("fen-%d", i)
			if _, err := s.AppendFenced(ctx, term, events.AggregateProxy, id, events.ProxyRunning, id+".running.1", data, &bus.Expect{Seq: 0}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
