package planner

import (
	"context"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

func TestRestartEmitsNothing(t *testing.T) {
	h := newHarness(t)
	first, ids, req := h.demoPool(3, "t1", "t2")
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)
	h.waitState(first, ids[0], events.ProxyReady)
	// Scale to 1: two retiring (deletes outstanding), one ready.
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	h.waitFor("2 deletes", func() bool { return len(h.commandsOf(events.VerbDelete)) == 2 })
	h.settle(first, 3)
	var before api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &before)
	first.stop()

	evSeq, cmdSeq := h.lastEventSeq(), h.lastSeq(bus.CommandsStream)
	second := h.startPlanner("p2", nil)
	h.waitFor("new leader", second.IsLeader)
	h.settle(second, 5)
	if got := h.lastEventSeq(); got != evSeq {
		t.Errorf("FLEET_EVENTS last seq after restart: got %d, want %d", got, evSeq)
	}
	if got := h.lastSeq(bus.CommandsStream); got != cmdSeq {
		t.Errorf("FLEET_CMDS last seq after restart: got %d, want %d", got, cmdSeq)
	}
	var after api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &after)
	if !equalJSON(before, after) {
		t.Errorf("rebuilt pool: got %+v, want %+v", after, before)
	}
}

func TestTwoPlannersOneLeader(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	a := h.startPlanner("a", nil)
	b := h.startPlanner("b", nil)
	h.waitFor("a leader", func() bool { return a.IsLeader() || b.IsLeader() })
	if a.IsLeader() && b.IsLeader() {
		t.Fatal("both planners lead")
	}
	lead, other := a, b
	if b.IsLeader() {
		lead, other = b, a
	}
	h.ok(poolApply, `{"name":"demo","provider":"local","size":3}`, nil)
	h.requested(3)
	h.settle(lead, 3)
	if other.IsLeader() || other.rounds.Load() != 0 {
		t.Errorf("follower leads=%v after %d rounds; want it idle", other.IsLeader(), other.rounds.Load())
	}
	// Both replicas answer the API from their own projection.
	h.waitFor("follower projection", func() bool { return other.poolView("demo").Active == 3 })

	// The leader stops; the other takes over and decides nothing new.
	lead.stop()
	h.waitFor("takeover", other.IsLeader)
	h.settle(other, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Errorf("requested: got %d, want 3", n)
	}
	if n := len(h.commandsOf(events.VerbCreate)); n != 3 {
		t.Errorf("create commands: got %d, want 3", n)
	}
}

// TestConflictIsRereadNotDoubleDecided drives the reconciler by hand on a
// stale snapshot: another decider retires the failed proxy first, so the
// planner's own retire conflicts and appends nothing, and the next round,
// on the re-read state, decides nothing more.
func TestConflictIsRereadNotDoubleDecided(t *testing.T) {
	h := newHarness(t)
	first, ids, _ := h.demoPool(1, "t1")
	h.settle(first, 2)
	first.stop()
	victim := ids[0]
	h.observe(victim, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "broken", Attempt: 1})

	p := h.manualPlanner()
	r := p.snapshot()
	// Another decider gets there first.
	last, err := h.store.Last(context.Background(), events.AggregateProxy, victim)
	if err != nil {
		t.Fatal(err)
	}
	other := events.ProxyRetiringData{Reason: "by someone else"}
	if _, err := h.store.Append(context.Background(), events.AggregateProxy, victim, events.ProxyRetiring, decisionID(victim, events.ProxyRetiring, last.Seq, other),
		other, &bus.Expect{Seq: last.Seq}); err != nil {
		t.Fatal(err)
	}
	f := p.flight(context.Background())
	p.reconcilePool(context.Background(), r, r.pools[0], f)
	f.wait()
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 1 {
		t.Fatalf("retiring events: got %d, want 1 (the planner's stale decision must conflict)", n)
	}
	if n := len(h.commandsOf(events.VerbDelete)); n != 0 {
		t.Fatalf("delete commands: got %d, want 0 from a refused decision", n)
	}
	// The replacement for the failed proxy is a decision of its own.
	h.requested(2)

	// Re-read, decide again: nothing left to do.
	h.feed(p.Planner)
	p.reconcile(context.Background())
	h.feed(p.Planner)
	p.reconcile(context.Background())
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 1 {
		t.Errorf("retiring after re-read: got %d, want 1", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Errorf("requested after re-read: got %d, want 2", n)
	}
}

// TestApplyConflictRereads makes the pool change between the planner's read
// and its append: the append conflicts, the planner re-reads the pool and
// applies on top of the newer revision.
func TestApplyConflictRereads(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	first := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	first.stop()

	p := h.manualPlanner()
	// A concurrent writer appends revision 2 the planner has not read.
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 2, Port: events.DefaultProxyPort}
	last, _ := h.store.Last(context.Background(), events.AggregatePool, "demo")
	rev2 := events.PoolAppliedData{Spec: spec, Revision: 2}
	if _, err := h.store.Append(context.Background(), events.AggregatePool, "demo", events.PoolApplied, decisionID("demo", events.PoolApplied, 2, rev2),
		rev2, &bus.Expect{Seq: last.Seq}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.store.Follow(ctx, p.st.seq+1, p.onEvent, nil)
	}()
	t.Cleanup(func() { cancel(); <-done })
	want := events.PoolSpec{Name: "demo", Provider: "local", Size: 5}
	want.Normalize()
	pv, aerr := backend{p.Planner}.ApplyPool(context.Background(), want)
	if aerr != nil {
		t.Fatalf("apply: %v", aerr)
	}
	if pv.Revision != 3 || pv.Spec.Size != 5 {
		t.Errorf("apply after conflict: got %+v, want revision 3 size 5", pv)
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	if len(applied) != 3 {
		t.Errorf("applied events: got %d, want 3", len(applied))
	}
}

// manualPlanner builds a planner whose state is replayed but which runs no
// loops, and the reconciler of a term of its own: the test drives it.
func (h *harness) manualPlanner() *reconciler {
	h.t.Helper()
	p, err := New(h.c, Config{ID: "manual"}, testLogger(), nil, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	if err := p.openSecrets(context.Background()); err != nil {
		h.t.Fatal(err)
	}
	// It decides as the leader would: in a term of its own.
	term, err := p.store.ClaimTerm(context.Background(), "manual", 0)
	if err != nil {
		h.t.Fatal(err)
	}
	l := &leadership{term: term, cancel: func() {}, jobs: make(chan leaderJob), ended: make(chan struct{})}
	p.lease.leading.Store(l)
	h.feed(p)
	p.caughtUp.Store(true)
	agents, _ := h.agents.ListKeys(context.Background())
	for k := range agents.Keys() {
		e, err := h.agents.Get(context.Background(), k)
		if err == nil {
			p.onAgent(e)
		}
	}
	return newReconciler(p, l)
}

// feed applies every event p has not seen yet.
func (h *harness) feed(p *Planner) {
	h.t.Helper()
	for _, e := range h.events() {
		_ = p.onEvent(e)
	}
}

// TestLeaderRecoversUnsentCommands: a leader that crashed between
// appending a decision and publishing its command left a proxy requested
// and one retiring with no command. The next leader publishes both, with
// attempt 1, and decides nothing else.
func TestLeaderRecoversUnsentCommands(t *testing.T) {
	h := newHarness(t)
	first := h.leader()
	// The entry is known (seen since start) but has no live target.
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.waitFor("agent seen", func() bool {
		first.mu.Lock()
		defer first.mu.Unlock()
		return len(first.agents.last) == 1
	})
	h.goneAgent("local", "t1")
	h.waitFor("agent gone", func() bool {
		first.mu.Lock()
		defer first.mu.Unlock()
		return len(first.agents.last) == 0
	})
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	h.settle(first, 2)
	first.stop()
	// No agent was live, so nothing was requested. Now the "crashed
	// leader's" decisions:
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	ctx := context.Background()
	decide := func(id, kind string, n uint64, data any, expect uint64) uint64 {
		seq, err := h.store.Append(ctx, events.AggregateProxy, id, kind, events.ProxyEventID(id, kind, n), data, &bus.Expect{Seq: expect})
		if err != nil {
			t.Fatal(err)
		}
		return seq
	}
	x, y := events.NewProxyID("demo"), events.NewProxyID("demo")
	req := func(id string) events.ProxyRequestedData {
		return events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128}}
	}
	decide(x, events.ProxyRequested, 1, req(x), 0)
	seq := decide(y, events.ProxyRequested, 1, req(y), 0)
	decide(y, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "scaled down"}, seq)
	evSeq := h.lastEventSeq()

	second := h.startPlanner("p2", nil)
	h.waitFor("leader", second.IsLeader)
	h.waitFor("recovered commands", func() bool { return len(h.commands()) >= 2 })
	h.settle(second, 3)
	cmds := h.commands()
	if len(cmds) != 2 {
		t.Fatalf("commands: got %d, want 2", len(cmds))
	}
	for _, c := range cmds {
		switch c.Verb {
		case events.VerbCreate:
			if c.Create.ProxyID != x || c.Create.Attempt != 1 {
				t.Errorf("create: got %+v, want %s attempt 1", c.Create, x)
			}
		case events.VerbDelete:
			if c.Delete.ProxyID != y || c.Delete.Attempt != 1 {
				t.Errorf("delete: got %+v, want %s attempt 1", c.Delete, y)
			}
		}
	}
	if got := h.lastEventSeq(); got != evSeq {
		t.Errorf("events appended by the new leader: last seq %d, want %d", got, evSeq)
	}
}

// TestDeposedLeaderDecidesNothing: a reconciler whose term was superseded
// decides a round from its state — retire a failed proxy, request its
// replacement — and the store refuses every decision: nothing is appended, no command is
// sent, and the replica is deposed.
func TestDeposedLeaderDecidesNothing(t *testing.T) {
	h := newHarness(t)
	first, ids, _ := h.demoPool(1, "t1")
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

// TestLargeRoundDecidesEveryProxyOnce: a pool filled in one round with
// more decisions than one fenced batch carries gets every proxy requested
// exactly once, spread over the targets, with one create command each;
// later rounds add nothing.
func TestLargeRoundDecidesEveryProxyOnce(t *testing.T) {
	const size = 3*batchDecisions + 17
	h := newHarness(t)
	for _, tg := range []string{"t1", "t2", "t3"} {
		h.agent(agent.Info{Entry: "local", Target: tg})
	}
	r := h.leader()
	h.ok(poolApply, `{"name":"big","provider":"local","size":`+strconv.Itoa(size)+`}`, nil)
	ids, req := h.requested(size)
	h.waitFor("a create per proxy", func() bool { return len(h.commandsOf(events.VerbCreate)) >= size })
	h.settle(r, 3)
	if _, again := h.requested(size); len(again) != size {
		t.Fatalf("requested after more rounds: %d, want %d", len(again), size)
	}
	perTarget := map[string]int{}
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			t.Fatalf("proxy %s requested twice", id)
		}
		seen[id] = true
		perTarget[req[id].Target]++
	}
	for tg, n := range perTarget {
		if n < size/3-1 || n > size/3+1 {
			t.Errorf("target %s holds %d proxies, want %d±1 (spread)", tg, n, size/3)
		}
	}
	creates := h.commandsOf(events.VerbCreate)
	if len(creates) != size {
		t.Fatalf("create commands: got %d, want %d", len(creates), size)
	}
	for _, c := range creates {
		if !seen[c.Create.ProxyID] || c.Create.Attempt != 1 || c.Create.Target != req[c.Create.ProxyID].Target {
			t.Fatalf("create %+v matches no requested proxy", c.Create)
		}
	}
	if v := r.poolView("big"); v.Active != size || v.States[events.ProxyRequested] != size {
		t.Errorf("pool: %+v, want %d requested", v, size)
	}
}

// TestRoundsLookOnlyAtChangedPools: once a fleet of pools settled, a round
// looks at no pool at all, and an event about one proxy has the next
// rounds look at its pool alone.
func TestRoundsLookOnlyAtChangedPools(t *testing.T) {
	const pools = 20
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	for i := range pools {
		h.ok(poolApply, `{"name":"p`+strconv.Itoa(i)+`","provider":"local","size":1}`, nil)
	}
	ids, req := h.requested(pools)
	for _, id := range ids {
		h.bringUp(id, req[id].Target, events.ProxyReady)
	}
	h.waitFor("every pool ready", func() bool {
		for i := range pools {
			if c, ok := h.condition("p"+strconv.Itoa(i), events.ConditionReady); !ok || c.Status != events.ConditionTrue {
				return false
			}
		}
		return true
	})
	h.folded(r)
	h.settle(r, 3)
	before := r.looked.Load()
	h.settle(r, 10)
	if n := r.looked.Load() - before; n != 0 {
		t.Errorf("pools looked at by 10 rounds of a settled fleet: %d, want 0", n)
	}

	before = r.looked.Load()
	h.observe(ids[7], events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3})
	h.waitFor("the pool's Ready condition to turn", func() bool {
		c, ok := h.condition(req[ids[7]].Pool, events.ConditionReady)
		return ok && c.Status == events.ConditionFalse
	})
	h.folded(r)
	h.settle(r, 10)
	// The unhealthy event, then the condition the leader recorded: the
	// pool looked at once or twice, no other pool.
	if n := r.looked.Load() - before; n < 1 || n > 3 {
		t.Errorf("pools looked at after one proxy turned unhealthy: %d, want 1 to 3 (its pool alone)", n)
	}
}

// TestUnreadableEventsBlockNothing: a message on a proxy's subjects whose
// envelope does not decode (here 0 bytes, on a decision's subject and on
// an agent's) is skipped by the fold, yet the next decision about the
// proxy expects its sequence: the operator's deletes land at once, and the
// lookup of a proxy's last event answers the last one that reads.
func TestUnreadableEventsBlockNothing(t *testing.T) {
	h := newHarness(t)
	_, ids, req := h.demoPool(2, "t1")
	h.bringUp(ids[0], req[ids[0]].Target, events.ProxyReady)
	ctx := context.Background()
	for _, subject := range []string{
		events.EventSubject(events.AggregateProxy, ids[0], events.ProxyRetiring),
		events.ObservationSubject(ids[1], events.ProxyRunning, "local", req[ids[1]].Target),
	} {
		if _, err := h.c.JS.Publish(ctx, subject, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		var x Proxy
		h.ok(proxyDelete, `{"id":"`+id+`"}`, &x)
		if x.State != events.ProxyRetiring {
			t.Errorf("%s after its delete: state %q, want retiring", id, x.State)
		}
	}
	last, err := h.store.Last(ctx, events.AggregateProxy, ids[1])
	if err != nil || last == nil || last.Unreadable != nil || last.Kind != events.ProxyRetiring {
		t.Errorf("last event of %s: %+v (%v), want its retiring", ids[1], last, err)
	}
}

// A round that events asked for waits as long as the round before it took,
// up to maxRest, and not at all after a round that did not run; a stop
// ends the wait.
func TestRoundsRestAsLongAsTheyTook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var rc reconciler
		for _, c := range []struct{ took, want time.Duration }{
			{0, 0}, {40 * time.Millisecond, 40 * time.Millisecond}, {time.Hour, maxRest},
		} {
			start := time.Now()
			rc.rest(t.Context(), c.took)
			if got := time.Since(start); got != c.want {
				t.Errorf("after a round of %v: rested %v, want %v", c.took, got, c.want)
			}
		}
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(10*time.Millisecond, cancel)
		start := time.Now()
		rc.rest(ctx, time.Hour)
		if got := time.Since(start); got != 10*time.Millisecond {
			t.Errorf("stopped after 10ms: rested %v", got)
		}
	})
}
