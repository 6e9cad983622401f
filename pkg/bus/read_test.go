package bus_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// Enough events that a read takes several pull requests, and a stall of
// the server's answer to one of them well beyond any wait after which a
// reader could take silence for the end (a pull request waiting 500 ms is
// given up by the client 1 s later).
const (
	stallEvents = 3000
	stallAt     = 1000
	stallFor    = 2 * time.Second
)

// appendPools appends n pool events (ids prefix-0 … prefix-(n-1)) and
// returns their sequences.
func appendPools(ctx context.Context, t *testing.T, s *bus.EventStore, prefix string, n int) []uint64 {
	t.Helper()
	seqs := make([]uint64, 0, n)
	for i := range n {
		id := fmt.Sprintf("%s-%d", prefix, i)
		seq, err := s.Append(ctx, events.AggregatePool, id, events.PoolApplied, id+".applied", map[string]int{"i": i}, nil)
		if err != nil {
			t.Fatalf("append %s: %v", id, err)
		}
		seqs = append(seqs, seq)
	}
	return seqs
}

// readerThrough returns a store on a second connection that reaches the
// server behind c through a relay the test can stall.
func readerThrough(t *testing.T, c *bus.Conn) (*bus.EventStore, *relay) {
	t.Helper()
	u, err := url.Parse(c.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	r := startRelay(t, u.Host)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := bus.Connect(ctx, bus.Config{URL: r.URL(), Name: t.Name() + "-reader", Replicas: 1}, nil)
	if err != nil {
		t.Fatalf("connect through the relay: %v", err)
	}
	t.Cleanup(d.Close)
	return bus.NewEventStore(d, "reader", nil), r
}

// diffSeqs describes how got differs from want.
func diffSeqs(got, want []uint64) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Sprintf("event %d is seq %d, want %d (%d delivered, %d wanted)", i, got[i], want[i], len(got), len(want))
		}
	}
	return fmt.Sprintf("%d delivered, %d wanted", len(got), len(want))
}

// A pause in the middle of a replay (network, busy server) delays it; it
// never ends it early.
func TestReplayOutlastsAStall(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)
	want := appendPools(ctx, t, bus.NewEventStore(c, "test", nil), "p", stallEvents)
	rs, r := readerThrough(t, c)

	var got []uint64
	err := rs.Replay(ctx, 0, func(e bus.Event) error {
		got = append(got, e.Seq)
		if len(got) == stallAt {
			r.StallAfterNextPull(stallFor)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Replay: %v", err)
	}
	if r.Stalls() != 1 {
		t.Fatalf("the relay stalled %d times, want 1: no pull request after event %d", r.Stalls(), stallAt)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("Replay across a %s stall: %s", stallFor, diffSeqs(got, want))
	}
}

// Follow reports caught up only once the last event that existed when it
// began was delivered, however long that takes, and exactly once.
func TestFollowCatchesUpAtTheEndItFound(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)
	w := bus.NewEventStore(c, "test", nil)
	want := appendPools(ctx, t, w, "p", stallEvents)
	rs, r := readerThrough(t, c)

	var got []uint64 // written and read on Follow's goroutine only
	calls := 0
	caught := make(chan []uint64, 1)
	live := make(chan uint64, 1)
	fctx, fcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- rs.Follow(fctx, 0, func(e bus.Event) error {
			got = append(got, e.Seq)
			if len(got) == stallAt {
				r.StallAfterNextPull(stallFor)
			}
			if e.Seq > want[len(want)-1] {
				live <- e.Seq
			}
			return nil
		}, func() {
			calls++
			caught <- slices.Clone(got)
		})
	}()
	select {
	case history := <-caught:
		if r.Stalls() != 1 {
			t.Fatalf("the relay stalled %d times, want 1: no pull request after event %d", r.Stalls(), stallAt)
		}
		if !slices.Equal(history, want) {
			t.Errorf("caught up after a %s stall with: %s", stallFor, diffSeqs(history, want))
		}
	case err := <-done:
		t.Fatalf("Follow returned %v before catching up", err)
	case <-ctx.Done():
		t.Fatal("never caught up")
	}
	seq := appendPools(ctx, t, w, "live", 1)[0]
	select {
	case got := <-live:
		if got != seq {
			t.Errorf("live event: got seq %d, want %d", got, seq)
		}
	case <-ctx.Done():
		t.Fatal("live event never delivered")
	}
	fcancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Follow returned %v, want context.Canceled", err)
	}
	if calls != 1 {
		t.Fatalf("caughtUp called %d times, want 1", calls)
	}
}

// With nothing at or after from, Follow is caught up before any event.
func TestFollowCaughtUpAtOnceWithNoHistory(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	for _, from := range []uint64{0, 3} {
		t.Run(fmt.Sprintf("from %d", from), func(t *testing.T) {
			if from > 0 {
				appendPools(ctx, t, s, "before", int(from)-1)
			}
			delivered := 0
			caught := make(chan int, 1)
			fctx, fcancel := context.WithCancel(ctx)
			defer fcancel()
			done := make(chan error, 1)
			go func() {
				done <- s.Follow(fctx, from, func(bus.Event) error { delivered++; return nil }, func() { caught <- delivered })
			}()
			select {
			case n := <-caught:
				if n != 0 {
					t.Errorf("caught up after %d events, want 0", n)
				}
			case <-ctx.Done():
				t.Fatal("never caught up")
			}
			fcancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("Follow returned %v, want context.Canceled", err)
			}
		})
	}
}

// An event that cannot be decoded is delivered by its position only
// (Unreadable set, an empty envelope: nothing a reader could act on) and
// still marks the end.
func TestReadersReachAnUndecodableLastEvent(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	want := appendPools(ctx, t, s, "p", 2)
	if _, err := c.JS.Publish(ctx, events.EventSubject(events.AggregatePool, "bad", events.PoolApplied), []byte("{not json")); err != nil {
		t.Fatal(err)
	}

	var got []uint64
	var bad []bus.Event
	if err := s.Replay(ctx, 0, func(e bus.Event) error {
		if e.Unreadable != nil {
			bad = append(bad, e)
		} else {
			got = append(got, e.Seq)
		}
		return nil
	}); err != nil {
		t.Fatalf("Replay: %v", err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("Replay: %s", diffSeqs(got, want))
	}
	if len(bad) != 1 || bad[0].Seq != want[len(want)-1]+1 || bad[0].ID != "bad" || bad[0].Envelope.ID != "" {
		t.Errorf("Replay delivered %+v as unreadable, want the one after %d, of pool bad, with an empty envelope", bad, want[len(want)-1])
	}
	evs, err := s.Load(ctx, events.AggregatePool, "bad")
	if err != nil || len(evs) != 1 || evs[0].Unreadable == nil {
		t.Errorf("Load(bad) = %+v, %v; want the one unreadable event", evs, err)
	}
	if last, err := s.Last(ctx, events.AggregatePool, "bad"); err != nil || last != nil {
		t.Errorf("Last(bad) = %+v, %v; want none: no event of pool bad reads", last, err)
	}

	fctx, fcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Follow(fctx, 0, func(bus.Event) error { return nil }, fcancel) }()
	if err := <-done; !errors.Is(err, context.Canceled) || ctx.Err() != nil {
		t.Fatalf("Follow returned %v (test context: %v); want context.Canceled from caughtUp", err, ctx.Err())
	}
}

// Load ends at the aggregate's own last event, not at the stream's.
func TestLoadEndsAtTheAggregatesLastEvent(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	want := appendPools(ctx, t, s, "a", 1)
	appendPools(ctx, t, s, "other", 5)
	evs, err := s.Load(ctx, events.AggregatePool, "a-0")
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if len(evs) != 1 || evs[0].Seq != want[0] {
		t.Fatalf("Load = %+v; want the one event at %d", evs, want[0])
	}
}

// Cancelling ctx stops a read that waits on a stalled server.
func TestReplayStopsWhenCancelledDuringAStall(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)
	appendPools(ctx, t, bus.NewEventStore(c, "test", nil), "p", stallEvents)
	rs, r := readerThrough(t, c)

	rctx, rcancel := context.WithCancel(ctx)
	n := 0
	err := rs.Replay(rctx, 0, func(bus.Event) error {
		n++
		if n == stallAt {
			r.StallAfterNextPull(stallFor)
			rcancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Replay returned %v after %d events, want context.Canceled", err, n)
	}
	if n >= stallEvents {
		t.Fatalf("Replay delivered all %d events after its context ended", n)
	}
}

// On a replicated stream the end comes from the stream leader; every
// reader delivers the whole history and leaves no consumer behind.
func TestReadersOnReplicatedStream(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := startCluster(t)
	s := bus.NewEventStore(c, "test", nil)
	want := appendPools(ctx, t, s, "p", 50)

	var got []uint64
	if err := s.Replay(ctx, 0, func(e bus.Event) error { got = append(got, e.Seq); return nil }); err != nil {
		t.Fatalf("Replay: %v", err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("Replay: %s", diffSeqs(got, want))
	}
	evs, err := s.Load(ctx, events.AggregatePool, "p-7")
	if err != nil || len(evs) != 1 || evs[0].Seq != want[7] {
		t.Errorf("Load(p-7) = %+v, %v; want the event at %d", evs, err, want[7])
	}
	var history []uint64
	fctx, fcancel := context.WithCancel(ctx)
	err = s.Follow(fctx, 0, func(e bus.Event) error { history = append(history, e.Seq); return nil }, fcancel)
	if !errors.Is(err, context.Canceled) || ctx.Err() != nil || !slices.Equal(history, want) {
		t.Errorf("Follow returned %v having delivered %s; want context.Canceled from caughtUp after every event", err, diffSeqs(history, want))
	}

	info := eventsInfo(ctx, t, c)
	// Follow ended with its context, so its consumer is left to expire.
	if info.State.Consumers > 1 {
		t.Errorf("%d consumers left on %s after the reads, want at most Follow's", info.State.Consumers, bus.EventsStream)
	}
}
