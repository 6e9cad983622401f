package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

func TestAppendExpectsAggregateWildcard(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)

	seq1, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{"a": "b"}, &bus.Expect{Seq: 0})
	if err != nil {
		t.Fatalf("first append: %v", err)
	}
	// Another aggregate in between must not disturb p1's expectation.
	if _, err := s.Append(ctx, events.AggregateProxy, "p2", events.ProxyRequested, "p2.requested.1", map[string]string{}, &bus.Expect{Seq: 0}); err != nil {
		t.Fatalf("p2 append: %v", err)
	}
	// A different event type of p1 with a stale expectation conflicts: the
	// check covers the whole aggregate, not one exact subject.
	_, err = s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.1", map[string]string{}, &bus.Expect{Seq: 0})
	if !errors.Is(err, bus.ErrConflict) {
		t.Fatalf("stale append: got %v, want ErrConflict", err)
	}
	seq3, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.1", map[string]string{}, &bus.Expect{Seq: seq1})
	if err != nil {
		t.Fatalf("current append: %v", err)
	}
	// Retrying the same decision (same Msg-Id, now-stale expectation) is our
	// own earlier success, not a conflict.
	again, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.1", map[string]string{}, &bus.Expect{Seq: seq1})
	if err != nil || again != seq3 {
		t.Fatalf("retry: got (%d, %v), want (%d, nil)", again, err, seq3)
	}
	last, err := s.Last(ctx, events.AggregateProxy, "p1")
	if err != nil || last == nil || last.Kind != events.ProxyRetiring || last.Seq != seq3 {
		t.Fatalf("Last = %+v, %v; want retiring at %d", last, err, seq3)
	}
	req, err := s.LastOf(ctx, events.AggregateProxy, "p1", events.ProxyRequested)
	if err != nil || req == nil || req.Seq != seq1 {
		t.Fatalf("LastOf(requested) = %+v, %v; want the event at %d", req, err, seq1)
	}
	none, err := s.Last(ctx, events.AggregateProxy, "nope")
	if err != nil || none != nil {
		t.Fatalf("Last(nope) = %+v, %v; want nil, nil", none, err)
	}
	evs, err := s.Load(ctx, events.AggregateProxy, "p1")
	if err != nil || len(evs) != 2 || evs[0].Kind != events.ProxyRequested || evs[1].Kind != events.ProxyRetiring {
		t.Fatalf("Load = %+v, %v", evs, err)
	}
}

func TestObservationsDeduplicateByMsgID(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	a, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRunning, "p1.running.1", map[string]string{"address": "x:1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Append(ctx, events.AggregateProxy, "p1", events.ProxyRunning, "p1.running.1", map[string]string{"address": "x:1"}, nil)
	if err != nil || a != b {
		t.Fatalf("duplicate append: got (%d, %v), want (%d, nil)", b, err, a)
	}
	st, _ := c.JS.Stream(ctx, bus.EventsStream)
	info, _ := st.Info(ctx)
	if info.State.Msgs != 1 {
		t.Fatalf("stream holds %d messages, want 1", info.State.Msgs)
	}
}

func TestFollowDeliversHistoryThenLive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	for i, id := range []string{"a", "b", "c"} {
		if _, err := s.Append(ctx, events.AggregatePool, id, events.PoolApplied, id+".applied", map[string]int{"i": i}, nil); err != nil {
			t.Fatal(err)
		}
	}
	got := make(chan bus.Event, 10)
	caught := make(chan struct{})
	fctx, fcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- s.Follow(fctx, 0, func(e bus.Event) error { got <- e; return nil }, func() { close(caught) })
	}()
	select {
	case <-caught:
	case <-ctx.Done():
		t.Fatal("never caught up")
	}
	if len(got) != 3 {
		t.Fatalf("history: got %d events before catch-up, want 3", len(got))
	}
	if _, err := s.Append(ctx, events.AggregatePool, "d", events.PoolApplied, "d.applied", map[string]int{}, nil); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		e := <-got
		if want := []string{"a", "b", "c", "d"}[i]; e.ID != want {
			t.Fatalf("event %d: got aggregate %q, want %q", i, e.ID, want)
		}
	}
	fcancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Follow returned %v, want context.Canceled", err)
	}
}

func TestReplayReturnsAtTheEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	if err := s.Replay(ctx, 0, func(bus.Event) error { t.Fatal("event in an empty stream"); return nil }); err != nil {
		t.Fatalf("Replay of an empty stream: %v", err)
	}
	var seqs []uint64
	for _, id := range []string{"a", "b", "c"} {
		seq, err := s.Append(ctx, events.AggregatePool, id, events.PoolApplied, id+".applied", map[string]int{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, seq)
	}
	var got []uint64
	if err := s.Replay(ctx, seqs[1], func(e bus.Event) error { got = append(got, e.Seq); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != seqs[1] || got[1] != seqs[2] {
		t.Fatalf("Replay from %d delivered %v, want %v", seqs[1], got, seqs[1:])
	}
}
