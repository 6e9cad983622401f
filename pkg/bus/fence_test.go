package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// streamCounts returns how many messages FLEET_EVENTS holds in all and on
// the fence subject.
func streamCounts(t *testing.T, c *bus.Conn) (all, fences uint64) {
	t.Helper()
	ctx := context.Background()
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(events.PlannerFenceSubject()))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs, info.State.Subjects[events.PlannerFenceSubject()]
}

// TestFencedAppendRejectedAfterNewerTerm is the storage-side guarantee the
// planner's leadership rests on: once another replica opened a term, a
// decision of the old term is refused — even the create of a brand-new
// aggregate, which no aggregate expectation can stop — and nothing of its
// batch is stored.
func TestFencedAppendRejectedAfterNewerTerm(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	a := bus.NewEventStore(c, "planner-a", nil)
	b := bus.NewEventStore(bustest.Dial(t, c), "planner-b", nil)

	ta, err := a.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatalf("claim term: %v", err)
	}
	if ta.Number != 1 {
		t.Fatalf("first term number %d, want 1", ta.Number)
	}
	seq, err := a.AppendFenced(ctx, ta, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{"pool": "demo"}, &bus.Expect{Seq: 0})
	if err != nil {
		t.Fatalf("fenced append in the current term: %v", err)
	}
	last, err := a.Last(ctx, events.AggregateProxy, "p1")
	if err != nil || last == nil || last.Seq != seq {
		t.Fatalf("Last(p1) = %+v, %v; want the decision at %d", last, err, seq)
	}
	if term, leader, ok := last.Leader(); !ok || term != 1 || leader != "a" {
		t.Fatalf("decision's leader attributes = (%d, %q, %v), want (1, \"a\", true)", term, leader, ok)
	}
	// A retry of the same decision is its own earlier success.
	again, err := a.AppendFenced(ctx, ta, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{"pool": "demo"}, &bus.Expect{Seq: 0})
	if err != nil || again != seq {
		t.Fatalf("retry: got (%d, %v), want (%d, nil)", again, err, seq)
	}
	// A stale aggregate expectation in the current term is a conflict, not
	// a deposition.
	_, err = a.AppendFenced(ctx, ta, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.x", map[string]string{}, &bus.Expect{Seq: 0})
	if !errors.Is(err, bus.ErrConflict) || errors.Is(err, bus.ErrFenced) {
		t.Fatalf("stale aggregate expectation: got %v, want ErrConflict", err)
	}

	// Another replica opens term 2; replica a has not noticed.
	tb, err := b.ClaimTerm(ctx, "b", 7)
	if err != nil || tb.Number != 2 {
		t.Fatalf("claim term 2: (%+v, %v)", tb, err)
	}
	before, _ := streamCounts(t, c)
	for _, tc := range []struct {
		name       string
		id, typ    string
		expect     *bus.Expect
		wantFenced bool
	}{
		// A new proxy: its aggregate is empty, so only the fence can
		// refuse it.
		{"create of a new aggregate", "p2", events.ProxyRequested, &bus.Expect{Seq: 0}, true},
		// An unchanged aggregate with a correct expectation.
		{"decision on an unchanged aggregate", "p1", events.ProxyRetiring, &bus.Expect{Seq: seq}, true},
		{"decision without expectation", "p3", events.ProxyFailed, nil, true},
	} {
		_, err := a.AppendFenced(ctx, ta, events.AggregateProxy, tc.id, tc.typ, tc.id+"."+tc.typ+".stale", map[string]string{}, tc.expect)
		if !errors.Is(err, bus.ErrFenced) {
			t.Errorf("%s by the deposed leader: got %v, want ErrFenced", tc.name, err)
		}
	}
	after, _ := streamCounts(t, c)
	if after != before {
		t.Fatalf("stream holds %d messages after the refused appends, had %d: a refused batch stored something", after, before)
	}
	if l, _ := a.Last(ctx, events.AggregateProxy, "p2"); l != nil {
		t.Fatalf("the deposed leader's create is in the log: %+v", l)
	}
	// The new leader decides normally, fences included.
	if _, err := b.AppendFenced(ctx, tb, events.AggregateProxy, "p1", events.ProxyRetiring, "p1.retiring.b", map[string]string{}, &bus.Expect{Seq: seq}); err != nil {
		t.Fatalf("new leader's decision: %v", err)
	}
	// The deposed replica cannot re-open its old term: the claim expects
	// the last term it read.
	cur, err := a.CurrentTerm(ctx)
	if err != nil || cur == nil || cur.Seq != tb.Seq || cur.Leader != "b" {
		t.Fatalf("CurrentTerm = %+v, %v; want b's term at %d", cur, err, tb.Seq)
	}
}

// TestClaimTermIsExclusive: two replicas that read the same current term
// cannot both open the next one.
func TestClaimTermIsExclusive(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "planner", nil)
	if _, err := s.ClaimTerm(ctx, "a", 1); err != nil {
		t.Fatal(err)
	}
	cur, err := s.CurrentTerm(ctx)
	if err != nil || cur == nil {
		t.Fatalf("CurrentTerm = %+v, %v", cur, err)
	}
	// Replica b opens term 2; a claim still based on term 1 must fail.
	if _, err := s.ClaimTerm(ctx, "b", 2); err != nil {
		t.Fatal(err)
	}
	_, err = c.JS.Publish(ctx, events.PlannerTermSubject(), []byte(`{}`),
		jetstream.WithExpectLastSequencePerSubject(cur.Seq))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		t.Fatalf("a claim expecting the superseded term: got %v, want a wrong-last-sequence error", err)
	}
}

// TestFenceMessagesExpire: fence messages do not accumulate in the log (the
// stream denies deletes and purges, but per-message TTLs still apply).
func TestFenceMessagesExpire(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "planner", nil)
	term, err := s.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.AppendFenced(ctx, term, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, &bus.Expect{Seq: 0}); err != nil {
		t.Fatal(err)
	}
	if _, fences := streamCounts(t, c); fences != 1 {
		t.Fatalf("fence messages right after the append: %d, want 1", fences)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		all, fences := streamCounts(t, c)
		if fences == 0 {
			if all != 2 {
				t.Fatalf("stream holds %d messages, want 2 (term and decision)", all)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("fence message still stored after %s", 15*time.Second)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTopologyUpgradesEventsStream: a deployment whose FLEET_EVENTS predates
// fencing gets atomic batches and message TTLs at the next start.
func TestTopologyUpgradesEventsStream(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	old := info.Config
	old.AllowAtomicPublish = false
	if _, err := c.JS.UpdateStream(ctx, old); err != nil {
		t.Fatalf("downgrade: %v", err)
	}
	s := bus.NewEventStore(c, "planner", nil)
	term, err := s.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.AppendFenced(ctx, term, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, nil); err == nil {
		t.Fatal("fenced append on a stream without atomic batches succeeded")
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatalf("EnsureTopology on an existing stream: %v", err)
	}
	if _, err := s.AppendFenced(ctx, term, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, nil); err != nil {
		t.Fatalf("fenced append after the upgrade: %v", err)
	}
}
