package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
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

// An agent's store appends its proxy events on the subject that names the
// agent; the planner's and health's stay on the aggregate's subject. A
// planner decision taken before an agent's observation conflicts with it
// (the aggregate's wildcard covers both shapes), reads give the
// observation's agent, and LastOf finds an agent's failed as well as the
// planner's.
func TestAgentObservationsNameTheAgent(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	planner := bus.NewEventStore(c, events.SourcePlanner, nil)
	agent := bus.NewEventStore(c, events.AgentSource("local", "t1"), nil)
	other := bus.NewEventStore(c, events.AgentSource("local", "t2"), nil)
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	subjectAt := func(seq uint64) string {
		t.Helper()
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		return m.Subject
	}

	req, err := planner.Append(ctx, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, &bus.Expect{Seq: 0})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := subjectAt(req), "fleet.evt.proxy.p1.requested"; got != want {
		t.Errorf("planner's requested on %q; want %q", got, want)
	}
	run, err := agent.Append(ctx, events.AggregateProxy, "p1", events.ProxyRunning, "p1.running.1", events.ProxyRunningData{Address: "127.0.0.1:1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := subjectAt(run), "fleet.evt.proxy.p1.running.local.t1"; got != want {
		t.Errorf("agent's running on %q; want %q", got, want)
	}
	// A decision that read the aggregate before the observation conflicts.
	if _, err := planner.Append(ctx, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.1", map[string]string{}, &bus.Expect{Seq: req}); !errors.Is(err, bus.ErrConflict) {
		t.Fatalf("decision expecting %d after an observation at %d: %v; want ErrConflict", req, run, err)
	}
	last, err := planner.Last(ctx, events.AggregateProxy, "p1")
	if err != nil || last == nil || last.Seq != run || last.Kind != events.ProxyRunning || last.By != (events.Observer{Entry: "local", Target: "t1"}) {
		t.Fatalf("Last = %+v, %v; want running by local/t1 at %d", last, err, run)
	}

	ofail, err := other.Append(ctx, events.AggregateProxy, "p1", events.ProxyFailed, "p1.failed.9", events.ProxyFailedData{Class: events.ClassPermanent}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := subjectAt(ofail), "fleet.evt.proxy.p1.failed.local.t2"; got != want {
		t.Errorf("other agent's failed on %q; want %q", got, want)
	}
	f, err := planner.LastOf(ctx, events.AggregateProxy, "p1", events.ProxyFailed)
	if err != nil || f == nil || f.Seq != ofail || f.By.Target != "t2" {
		t.Fatalf("LastOf(failed) = %+v, %v; want the agent's at %d", f, err, ofail)
	}
	pfail, err := planner.Append(ctx, events.AggregateProxy, "p1", events.ProxyFailed, "p1.failed.10", events.ProxyFailedData{Class: events.ClassTimeout}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := subjectAt(pfail), "fleet.evt.proxy.p1.failed"; got != want {
		t.Errorf("planner's failed on %q; want %q", got, want)
	}
	if f, err = planner.LastOf(ctx, events.AggregateProxy, "p1", events.ProxyFailed); err != nil || f == nil || f.Seq != pfail || !f.By.IsZero() {
		t.Fatalf("LastOf(failed) = %+v, %v; want the planner's at %d", f, err, pfail)
	}
	// An agent reads its own observations only.
	if o, err := agent.LastObservation(ctx, "p1", events.ProxyFailed, events.Observer{Entry: "local", Target: "t1"}); err != nil || o != nil {
		t.Fatalf("LastObservation(failed, local/t1) = %+v, %v; want none", o, err)
	}
	if o, err := agent.LastObservation(ctx, "p1", events.ProxyRunning, events.Observer{Entry: "local", Target: "t1"}); err != nil || o == nil || o.Seq != run {
		t.Fatalf("LastObservation(running, local/t1) = %+v, %v; want the event at %d", o, err, run)
	}
	evs, err := planner.Load(ctx, events.AggregateProxy, "p1")
	if err != nil || len(evs) != 4 {
		t.Fatalf("Load = %d events, %v; want 4", len(evs), err)
	}

	// What an agent acts on: decisions, health's observations and its own,
	// never another agent's.
	t1, t2 := events.Observer{Entry: "local", Target: "t1"}, events.Observer{Entry: "local", Target: "t2"}
	odel, err := other.Append(ctx, events.AggregateProxy, "p1", events.ProxyDeleted, "p1.deleted.9", events.ProxyDeletedData{Attempt: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if e, err := agent.LastSeenBy(ctx, "p1", t1); err != nil || e == nil || e.Seq != pfail {
		t.Fatalf("LastSeenBy(local/t1) after local/t2's deleted = %+v, %v; want the planner's failed at %d", e, err, pfail)
	}
	if e, err := other.LastSeenBy(ctx, "p1", t2); err != nil || e == nil || e.Seq != odel {
		t.Fatalf("LastSeenBy(local/t2) = %+v, %v; want its deleted at %d", e, err, odel)
	}
	del, err := agent.Append(ctx, events.AggregateProxy, "p1", events.ProxyDeleted, "p1.deleted.1", events.ProxyDeletedData{Attempt: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if e, err := agent.LastSeenBy(ctx, "p1", t1); err != nil || e == nil || e.Seq != del || e.By != t1 {
		t.Fatalf("LastSeenBy(local/t1) = %+v, %v; want its own deleted at %d", e, err, del)
	}
	if e, err := agent.LastSeenBy(ctx, "nope", t1); err != nil || e != nil {
		t.Fatalf("LastSeenBy(nope) = %+v, %v; want nil, nil", e, err)
	}
}

func TestFollowDeliversHistoryThenLive(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
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
	ctx := testwait.Context(t, 20*time.Second)
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
