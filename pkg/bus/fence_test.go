package bus_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// eventsInfo returns the stream info of FLEET_EVENTS, asked with opts.
func eventsInfo(ctx context.Context, t testing.TB, c *bus.Conn, opts ...jetstream.StreamInfoOpt) *jetstream.StreamInfo {
	t.Helper()
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// streamCounts returns how many messages FLEET_EVENTS holds in all and on
// the fence subject.
func streamCounts(t *testing.T, c *bus.Conn) (all, fences uint64) {
	t.Helper()
	info := eventsInfo(context.Background(), t, c, jetstream.WithSubjectFilter(events.PlannerFenceSubject()))
	return info.State.Msgs, info.State.Subjects[events.PlannerFenceSubject()]
}

// eventCount is how many messages FLEET_EVENTS holds besides fences, from
// one reading. A fence expires a second after its batch was stored
// (FenceTTL), so the whole count can fall between two readings while
// nothing is appended; this one only grows.
func eventCount(t *testing.T, c *bus.Conn) uint64 {
	t.Helper()
	all, fences := streamCounts(t, c)
	return all - fences
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
	before := eventCount(t, c)
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
	after := eventCount(t, c)
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
	old := eventsInfo(ctx, t, c).Config
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

// TestStartFencedBatches: a batch of decisions on many aggregates, each
// with its own expectation, is stored whole, its events together; one
// failed expectation refuses the whole batch; a batch that repeats a
// stored decision is refused too, while a lone retry is its own earlier
// success; and after a newer term opened, every batch is fenced.
func TestStartFencedBatches(t *testing.T) {
	ctx := context.Background()
	c := bustest.Start(t)
	a := bus.NewEventStore(c, "planner-a", nil)
	ta, err := a.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatal(err)
	}
	create := func(id string, expect uint64) bus.Decision {
		return bus.Decision{Aggregate: events.AggregateProxy, ID: id, Type: events.ProxyRequested, MsgID: id + ".requested.1",
			Data: map[string]string{"id": id}, Expect: &bus.Expect{Seq: expect}}
	}
	last := func(id string) *bus.Event {
		t.Helper()
		e, err := a.Last(ctx, events.AggregateProxy, id)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	lastSeq := func() uint64 {
		t.Helper()
		return eventsInfo(ctx, t, c).State.LastSeq
	}
	// Ten batches of 50 creates; batch 3's 7th decision expects its
	// aggregate at 9, which it is not.
	var prev uint64
	for b := range 10 {
		var ds []bus.Decision
		for i := range 50 {
			expect := uint64(0)
			if b == 3 && i == 7 {
				expect = 9
			}
			ds = append(ds, create(fmt.Sprintf("px%d-%d", b, i), expect))
		}
		seq, err := a.StartFenced(ctx, ta, ds...).Wait(ctx)
		if b == 3 {
			if !errors.Is(err, bus.ErrConflict) {
				t.Errorf("batch 3: got %d, %v; want ErrConflict", seq, err)
			}
			for i := range 50 {
				if e := last(fmt.Sprintf("px3-%d", i)); e != nil {
					t.Fatalf("the refused batch stored %+v", e)
				}
			}
			continue
		}
		if err != nil || seq <= prev {
			t.Fatalf("batch %d: got %d, %v; want a sequence after %d", b, seq, err, prev)
		}
		prev = seq
		// The batch's events are stored together, ending at seq.
		for i := range 50 {
			if e := last(fmt.Sprintf("px%d-%d", b, i)); e == nil || e.Seq != seq-uint64(49-i) {
				t.Fatalf("px%d-%d: %+v; want stored at %d", b, i, e, seq-uint64(49-i))
			}
		}
	}
	// Two conditions of one pool: the second rides on the first's
	// expectation.
	pseq, err := a.StartFenced(ctx, ta,
		bus.Decision{Aggregate: events.AggregatePool, ID: "demo", Type: events.PoolCondition, MsgID: "demo.condition.a", Data: map[string]string{"n": "1"}, Expect: &bus.Expect{Seq: 0}},
		bus.Decision{Aggregate: events.AggregatePool, ID: "demo", Type: events.PoolCondition, MsgID: "demo.condition.b", Data: map[string]string{"n": "2"}}).Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	evs, err := a.Load(ctx, events.AggregatePool, "demo")
	if err != nil || len(evs) != 2 || evs[1].Seq != pseq || evs[0].Envelope.ID != "demo.condition.a" || evs[1].Envelope.ID != "demo.condition.b" {
		t.Fatalf("pool batch: %d events (%v), want both conditions, the last at %d", len(evs), err, pseq)
	}

	// A batch repeating a stored decision is refused whole; the lone
	// retry is its own earlier success.
	before := lastSeq()
	if _, err := a.StartFenced(ctx, ta, create("fresh", 0), create("px7-1", 0)).Wait(ctx); !errors.Is(err, bus.ErrConflict) {
		t.Errorf("batch with a stored decision: got %v, want ErrConflict", err)
	}
	if e := last("fresh"); e != nil || lastSeq() != before {
		t.Errorf("the refused batch stored something: %+v", e)
	}
	again, err := a.StartFenced(ctx, ta, create("px7-1", 0)).Wait(ctx)
	if e := last("px7-1"); err != nil || e == nil || again != e.Seq {
		t.Errorf("lone retry of px7-1: got %d, %v; want its sequence", again, err)
	}

	// Another term opens: the old leader's batches are fenced, and none
	// of them is stored.
	if _, err := bus.NewEventStore(bustest.Dial(t, c), "planner-b", nil).ClaimTerm(ctx, "b", 2); err != nil {
		t.Fatal(err)
	}
	before = lastSeq()
	for i := range 5 {
		if _, err := a.StartFenced(ctx, ta, create(fmt.Sprintf("late%d", i), 0), create(fmt.Sprintf("later%d", i), 0)).Wait(ctx); !errors.Is(err, bus.ErrFenced) {
			t.Errorf("late batch %d: got %v, want ErrFenced", i, err)
		}
	}
	if after := lastSeq(); after != before {
		t.Fatalf("the stream's last sequence is %d after the fenced batches, was %d: a refused batch stored something", after, before)
	}
}
