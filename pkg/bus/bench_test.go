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
	// fenced-batched is one decision of fenced batches of 256, as the
	// planner's reconciler sends them: the server's fixed cost of an
	// atomic batch is shared by its decisions.
	runs := 0
	b.Run("fenced-batched", func(b *testing.B) {
		runs++
		term, err := s.ClaimTerm(ctx, "bench", uint64(runs))
		if err != nil {
			b.Fatal(err)
		}
		var ds []bus.Decision
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("bat-%d-%d", runs, i)
			ds = append(ds, bus.Decision{Aggregate: events.AggregateProxy, ID: id, Type: events.ProxyRunning, MsgID: id + ".running.1", Data: data, Expect: &bus.Expect{Seq: 0}})
			if len(ds) == 256 || i == b.N-1 {
				if _, err := s.StartFenced(ctx, term, ds...).Wait(ctx); err != nil {
					b.Fatal(err)
				}
				ds = nil
			}
		}
	})
}

// replayEvents is the length of the stream BenchmarkReplay reads.
const replayEvents = 100_000

// BenchmarkReplay measures EventStore.Replay of a stream of small proxy
// events against a baseline measured in the same run: a bare read of the
// same stream through one ordered consumer with the same read-ahead, doing
// nothing per message. Both report events/s; replay also reports its ratio
// to the fastest baseline of the run as replay/bare (the goal is at least
// 0.25).
func BenchmarkReplay(b *testing.B) {
	ctx := context.Background()
	c := bustest.Start(b)
	s := bus.NewEventStore(c, "bench", nil)
	last := appendSmallEvents(ctx, b, c, replayEvents)

	rate := func(b *testing.B) float64 {
		r := float64(replayEvents) * float64(b.N) / b.Elapsed().Seconds()
		b.ReportMetric(r, "events/s")
		return r
	}
	var bare float64
	b.Run("baseline", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if n := bareRead(ctx, b, c, last); n != replayEvents {
				b.Fatalf("bare read: %d events, want %d", n, replayEvents)
			}
		}
		// The best baseline of the run: the ratio errs low, not high,
		// on a busy machine.
		bare = max(bare, rate(b))
	})
	b.Run("replay", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			n := 0
			if err := s.Replay(ctx, 0, func(bus.Event) error { n++; return nil }); err != nil {
				b.Fatal(err)
			}
			if n != replayEvents {
				b.Fatalf("Replay: %d events, want %d", n, replayEvents)
			}
		}
		if r := rate(b); bare > 0 {
			b.ReportMetric(r/bare, "replay/bare")
		}
	})
}

// appendSmallEvents stores n proxy running events, as agents append them,
// over 1,000 proxies, and returns the last sequence.
func appendSmallEvents(ctx context.Context, b *testing.B, c *bus.Conn, n int) uint64 {
	b.Helper()
	const window = 4096
	for i := range n {
		id := fmt.Sprintf("px-%016d", i%1000)
		msgID := fmt.Sprintf("%s.running.%d", id, i)
		data := events.ProxyRunningData{Address: "127.0.0.1:20000", Attempt: 1, ProviderID: "px-aaaaaaaaaaaaaaaa"}
		env, err := events.NewEnvelope(msgID, events.AgentSource("local", "t1"), events.EnvelopeType(events.AggregateProxy, events.ProxyRunning), id, time.Now(), data)
		if err != nil {
			b.Fatal(err)
		}
		body, err := env.MarshalJSON()
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.JS.PublishAsync(events.EventSubject(events.AggregateProxy, id, events.ProxyRunning), body, jetstream.WithMsgID(msgID)); err != nil {
			b.Fatal(err)
		}
		if i%window == window-1 || i == n-1 {
			select {
			case <-c.JS.PublishAsyncComplete():
			case <-ctx.Done():
				b.Fatal(ctx.Err())
			}
		}
	}
	info := eventsInfo(ctx, b, c)
	if info.State.Msgs != uint64(n) {
		b.Fatalf("stream holds %d events, want %d", info.State.Msgs, n)
	}
	return info.State.LastSeq
}

// bareRead reads FLEET_EVENTS up to sequence last through one ordered
// consumer, doing nothing with the messages, and returns how many it read.
func bareRead(ctx context.Context, b *testing.B, c *bus.Conn, last uint64) int {
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		b.Fatal(err)
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{events.EventsAll}})
	if err != nil {
		b.Fatal(err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(bus.ReadAhead))
	if err != nil {
		b.Fatal(err)
	}
	defer it.Stop()
	n := 0
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			b.Fatal(err)
		}
		n++
		md, err := msg.Metadata()
		if err != nil {
			b.Fatal(err)
		}
		if md.Sequence.Stream >= last {
			return n
		}
	}
}
