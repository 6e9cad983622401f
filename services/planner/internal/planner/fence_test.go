package planner

import (
	"context"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// TestDeposedLeaderDecidesNothing: a reconciler whose term was superseded
// decides a round from its state — retire a failed proxy, request its
// replacement — and the store refuses every decision: nothing is appended, no command is
// sent, and the replica is deposed.
func TestDeposedLeaderDecidesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	first := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	first.stop()
	// The proxy failed: a leader retires it and requests a replacement.
	h.observe(ids[0], events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "broken", Attempt: 1})

	p := h.manualPlanner() // holds a term of its own
	// Another replica takes over.
	if _, err := h.store.ClaimTerm(context.Background(), "other", 99); err != nil {
		t.Fatal(err)
	}
	before := len(h.commands())
	p.reconcile(context.Background())
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 1 {
		t.Errorf("requested events: got %d, want 1 (the deposed leader's create must be refused)", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Errorf("retiring events: got %d, want 0 (the deposed leader's retire must be refused)", n)
	}
	if n := len(h.commands()); n != before {
		t.Errorf("commands: got %d, want %d: a refused decision sent its command", n, before)
	}
	if p.lease.leading.Load() != nil {
		t.Error("the replica still holds its term after a refused decision")
	}
}

// TestNewerTermDeposesAndLeaseIsReelected: a replica that opened a term
// after this one (a leader that paused right after it acquired the lease
// and resumed after losing it) deposes the leader at once; the deposed
// leader gives the lease back, and the replicas elect a leader with a fresh
// term, which decides.
func TestNewerTermDeposesAndLeaseIsReelected(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	ctx := context.Background()
	late, err := h.store.ClaimTerm(ctx, "late", 42)
	if err != nil {
		t.Fatal(err)
	}
	h.waitFor("a fresh term after the late one", func() bool {
		cur, err := h.store.CurrentTerm(ctx)
		return err == nil && cur != nil && cur.Seq > late.Seq && cur.Leader == "p1"
	})
	h.waitFor("leader", r.IsLeader)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":2}`, nil)
	h.requested(2)
	cur, err := h.store.CurrentTerm(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		if term, leader, ok := e.Leader(); !ok || term != cur.Number || leader != "p1" {
			t.Errorf("requested %s: leader attributes (%d, %q, %v), want (%d, \"p1\", true)", e.ID, term, leader, ok, cur.Number)
		}
	}
}
