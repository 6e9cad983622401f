package planner

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// logGen appends a realistic FLEET_EVENTS history directly, as the planner,
// the agents and the health service would have written it: pools applied,
// re-applied with another size and deleted, pool conditions, proxies
// through their whole lifecycle (requested, provisioning, running, ready,
// retiring, deleted), rotations and recycles (a replacement requested
// naming the proxy it replaces), bans, unhealthy spells, failures reported
// by agents (quota, terminated) and abandoned proxies. Its choices come
// from a seeded generator, so a seed gives one history. Every publish is
// asynchronous and every acknowledgement is checked.
type logGen struct {
	tb      testing.TB
	js      jetstream.JetStream
	rng     *rand.Rand
	now     time.Time
	pending []jetstream.PubAckFuture
	// n counts the events appended.
	n int
	// failed is set once an append failed (reported with Errorf, so a
	// generator may run on a goroutine of its own): it appends no more.
	failed bool

	pools map[string]*genPool
	names []string
	// inflight are proxies on their way up, deleting proxies retiring
	// whose agent did not report them deleted yet: later steps move them
	// on, so a history holds proxies in every state at any point.
	inflight []*genProxy
	deleting []string
}

// genProxy is a proxy on its way up: stage counts the events appended
// (1: requested, 2: provisioning, 3: running).
type genProxy struct {
	id, target string
	pool       *genPool
	stage      int
}

// genPool is one generated pool: its spec and its proxies by state.
type genPool struct {
	name     string
	revision int
	size     int
	deleted  bool
	targets  []string
	// live are its proxies that are up (ready or unhealthy), in order of
	// creation; unhealthy marks those that are not ready.
	live      []string
	unhealthy map[string]bool
	proxies   int
	// pending counts its proxies on their way up.
	pending int
	// finished are its deleted or abandoned proxies.
	finished []string
}

func newLogGen(tb testing.TB, c *bus.Conn, seed uint64) *logGen {
	return &logGen{tb: tb, js: c.JS, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		now: time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC), pools: map[string]*genPool{}}
}

// fail reports an append that failed.
func (g *logGen) fail(format string, args ...any) {
	g.tb.Errorf(format, args...)
	g.failed = true
}

// emit appends one event.
func (g *logGen) emit(aggregate, id, typ, msgID, source string, data any) {
	if g.failed {
		return
	}
	g.now = g.now.Add(time.Duration(1+g.rng.IntN(1000)) * time.Millisecond)
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(aggregate, typ), id, g.now, data)
	if err == nil {
		var body []byte
		body, err = env.MarshalJSON()
		msg := nats.NewMsg(events.SubjectOf(source, aggregate, id, typ))
		msg.Data = body
		msg.Header.Set(jetstream.MsgIDHeader, msgID)
		var f jetstream.PubAckFuture
		if err == nil {
			f, err = g.js.PublishMsgAsync(msg)
		}
		if err == nil {
			g.pending = append(g.pending, f)
		}
	}
	if err != nil {
		g.fail("append %s %s %s: %v", aggregate, id, typ, err)
		return
	}
	g.n++
	if len(g.pending) >= 2048 {
		g.flush()
	}
}

// flush waits for every outstanding acknowledgement.
func (g *logGen) flush() {
	for _, f := range g.pending {
		if g.failed {
			break
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			g.fail("append %s: %v", f.Msg().Subject, err)
		case <-time.After(30 * time.Second):
			g.fail("append %s: no acknowledgement", f.Msg().Subject)
		}
	}
	g.pending = g.pending[:0]
}

func (g *logGen) planner(id, typ string, n uint64, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.%s.%d.g%d", id, typ, n, g.n), events.SourcePlanner, data)
}

func (g *logGen) agentFact(id, target, typ string, n uint64, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.g%d", events.ProxyEventID(id, typ, n), g.n), events.AgentSource("local", target), data)
}

func (g *logGen) health(id, typ string, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.%s.g%d", id, typ, g.n), events.SourceHealth, data)
}

// apply applies (or re-applies) pool name with size.
func (g *logGen) apply(name string, size int) {
	p := g.pools[name]
	if p == nil {
		p = &genPool{name: name, targets: []string{"t1", "t2", "t3"}, unhealthy: map[string]bool{}}
		g.pools[name] = p
		g.names = append(g.names, name)
	}
	p.revision++
	p.size, p.deleted = size, false
	spec := events.PoolSpec{Name: name, Provider: "local", Size: size, Port: 3128, MaxAge: events.Duration(time.Hour)}
	spec.Normalize()
	d := events.PoolAppliedData{Spec: spec.Public(), Revision: p.revision, SecretsDigest: events.PoolSecrets{}.Digest(nil)}
	g.emit(events.AggregatePool, name, events.PoolApplied, fmt.Sprintf("%s.applied.%d", name, p.revision), events.SourcePlanner, d)
}

// autoscale re-applies pool name with autoscale and has the planner
// scale it to size, so the pool wants size proxies as after apply.
func (g *logGen) autoscale(name string, size int) {
	p := g.pools[name]
	p.revision++
	spec := events.PoolSpec{Name: name, Provider: "local", Size: 1, Port: 3128, MaxAge: events.Duration(time.Hour),
		Autoscale: &events.Autoscale{Min: 1, Max: size + 3, TargetConnections: 10}}
	spec.Normalize()
	d := events.PoolAppliedData{Spec: spec.Public(), Revision: p.revision, SecretsDigest: events.PoolSecrets{}.Digest(nil)}
	g.emit(events.AggregatePool, name, events.PoolApplied, fmt.Sprintf("%s.applied.%d", name, p.revision), events.SourcePlanner, d)
	sd := events.PoolScaledData{Size: size, Previous: p.size, Reason: fmt.Sprintf("autoscale: %d connections for %d proxies", 10*size, size)}
	g.emit(events.AggregatePool, name, events.PoolScaled, fmt.Sprintf("%s.scaled.g%d", name, g.n), events.SourcePlanner, sd)
	p.size = size
}

// condition records one pool condition.
func (g *logGen) condition(name, status, reason string) {
	d := events.PoolConditionData{Type: events.ConditionReady, Status: status, Reason: reason, Message: reason}
	g.emit(events.AggregatePool, name, events.PoolCondition, fmt.Sprintf("%s.condition.g%d", name, g.n), events.SourcePlanner, d)
}

// create requests one new proxy of pool p, replacing replaces (with why)
// if set, and takes it up to ready now or, half the time, over later
// steps.
func (g *logGen) create(p *genPool, replaces, why string) {
	p.proxies++
	id := fmt.Sprintf("%s-%010d", p.name, p.proxies)
	target := p.targets[g.rng.IntN(len(p.targets))]
	g.planner(id, events.ProxyRequested, 1, events.ProxyRequestedData{
		ProxySpec:     events.ProxySpec{Pool: p.name, Entry: "local", Target: target, Instance: events.InstanceName(id), Revision: p.revision, Port: 3128},
		Replaces:      replaces,
		ReplaceReason: why,
	})
	x := &genProxy{id: id, target: target, pool: p, stage: 1}
	if g.rng.IntN(2) == 0 {
		for x.stage > 0 {
			g.advance(x)
		}
		return
	}
	p.pending++
	g.inflight = append(g.inflight, x)
}

// advance appends the next event of a proxy on its way up; stage 0 means
// it is up (or failed and retired).
func (g *logGen) advance(x *genProxy) {
	id, p := x.id, x.pool
	switch x.stage {
	case 1:
		g.agentFact(id, x.target, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: x.target,
			Instance: events.InstanceName(id), ProviderID: "pid-" + id, Attempt: 1})
		x.stage = 2
	case 2:
		if g.rng.IntN(20) == 0 {
			g.agentFact(id, x.target, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "quota exceeded", Attempt: 1})
			g.planner(id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "failed: quota"})
			g.deleting = append(g.deleting, id)
			p.finished = append(p.finished, id)
			x.stage = 0
			return
		}
		g.agentFact(id, x.target, events.ProxyRunning, 1, events.ProxyRunningData{ProviderID: "pid-" + id,
			Address: fmt.Sprintf("127.0.0.1:%d", 20000+p.proxies%1000), Attempt: 1})
		x.stage = 3
	case 3:
		g.health(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:1", LatencyMS: int64(g.rng.IntN(50))})
		p.live = append(p.live, id)
		x.stage = 0
	}
}

// moveOn advances one proxy on its way up and reports one retiring proxy
// deleted, now and then.
func (g *logGen) moveOn() {
	for range 3 {
		if len(g.inflight) == 0 || g.rng.IntN(4) == 0 {
			break
		}
		i := g.rng.IntN(len(g.inflight))
		x := g.inflight[i]
		g.advance(x)
		if x.stage == 0 {
			x.pool.pending--
			g.inflight = append(g.inflight[:i], g.inflight[i+1:]...)
		}
	}
	if len(g.deleting) > 0 && g.rng.IntN(3) == 0 {
		i := g.rng.IntN(len(g.deleting))
		g.agentFact(g.deleting[i], "t1", events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		g.deleting = append(g.deleting[:i], g.deleting[i+1:]...)
	}
}

// retire takes the i-th live proxy of p through retiring to deleted (or
// abandoned, when skip).
func (g *logGen) retire(p *genPool, i int, reason string, skip bool) {
	id := p.live[i]
	p.live = append(p.live[:i], p.live[i+1:]...)
	delete(p.unhealthy, id)
	p.finished = append(p.finished, id)
	g.planner(id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: reason, SkipCleanup: skip})
	switch {
	case skip:
		g.planner(id, events.ProxyAbandoned, 1, events.ProxyAbandonedData{Reason: reason})
	case g.rng.IntN(2) == 0:
		g.deleting = append(g.deleting, id)
	default:
		g.agentFact(id, "t1", events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	}
}

// step appends one burst of activity.
func (g *logGen) step() {
	g.moveOn()
	if len(g.names) == 0 || g.rng.IntN(200) == 0 {
		g.apply(fmt.Sprintf("pool%d", len(g.names)), 5+g.rng.IntN(20))
		return
	}
	p := g.pools[g.names[g.rng.IntN(len(g.names))]]
	switch {
	case p.deleted:
		if g.rng.IntN(4) == 0 {
			g.apply(p.name, 3+g.rng.IntN(10))
		}
	case len(p.live)+p.pending < p.size:
		g.create(p, "", "")
	case len(p.live) > p.size:
		g.retire(p, 0, "scaled down", false)
	case len(p.live) == 0:
		// Every proxy it wants is on its way up.
	default:
		switch r := g.rng.IntN(100); {
		case r < 50: // rotation, surge first
			old := g.rng.IntN(len(p.live))
			oldID := p.live[old]
			g.create(p, oldID, "rotated: older than maxAge 1h0m0s")
			g.retire(p, old, "rotated: older than maxAge 1h0m0s", false)
		case r < 60: // ban: retired at once, replaced
			i := g.rng.IntN(len(p.live))
			g.create(p, p.live[i], "banned: 403")
			g.retire(p, i, "banned: 403", false)
		case r < 72: // an unhealthy spell
			id := p.live[g.rng.IntN(len(p.live))]
			if p.unhealthy[id] {
				g.health(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:1"})
				delete(p.unhealthy, id)
			} else {
				g.health(id, events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3})
				p.unhealthy[id] = true
			}
		case r < 78: // the backend lost or refused it
			i := g.rng.IntN(len(p.live))
			id := p.live[i]
			class := events.ClassTerminated
			if g.rng.IntN(2) == 0 {
				class = events.ClassQuota
			}
			g.agentFact(id, "t2", events.ProxyFailed, 1, events.ProxyFailedData{Class: class, Reason: "backend says " + class, Attempt: 1})
			g.retire(p, i, "failed: "+class, false)
		case r < 80: // abandoned by the operator
			g.retire(p, g.rng.IntN(len(p.live)), "deleted by operator, cleanup skipped", true)
		case r < 88:
			g.condition(p.name, events.ConditionFalse, events.ReasonNotEnoughReady)
			g.condition(p.name, events.ConditionTrue, events.ReasonEnoughReady)
		case r < 94: // scaled, by a re-apply or by autoscaling
			if size := max(1, p.size+g.rng.IntN(7)-3); p.revision%2 == 0 {
				g.apply(p.name, size)
			} else {
				g.autoscale(p.name, size)
			}
		case r < 95: // deleted: every proxy retires
			p.deleted = true
			p.revision++
			g.emit(events.AggregatePool, p.name, events.PoolDeleted, fmt.Sprintf("%s.deleted.%d", p.name, p.revision), events.SourcePlanner,
				events.PoolDeletedData{Revision: p.revision})
			for len(p.live) > 0 {
				g.retire(p, 0, "pool deleted", false)
			}
			for i := 0; i < len(g.inflight); i++ {
				if x := g.inflight[i]; x.pool == p {
					g.planner(x.id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "pool deleted"})
					g.deleting = append(g.deleting, x.id)
					p.finished = append(p.finished, x.id)
					g.inflight = append(g.inflight[:i], g.inflight[i+1:]...)
					i--
				}
			}
			p.pending = 0
		default: // a late observation of a finished proxy's agent
			if len(p.finished) > 0 {
				id := p.finished[g.rng.IntN(len(p.finished))]
				g.agentFact(id, "t1", events.ProxyDeleted, 9, events.ProxyDeletedData{Attempt: 9})
			}
		}
	}
}

// fill appends activity until at least n events were appended.
func (g *logGen) fill(n int) {
	for g.n < n && !g.failed {
		g.step()
	}
	g.flush()
	if g.failed {
		g.tb.FailNow()
	}
}

// streamEvents returns every message of FLEET_EVENTS from sequence from on,
// decoded as the planner's follow delivers them (leader terms and the
// fences that did not expire yet included).
func streamEvents(tb testing.TB, c *bus.Conn, from uint64) []bus.Event {
	tb.Helper()
	var out []bus.Event
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	store := bus.NewEventStore(c, "reader", nil)
	if err := store.Replay(ctx, from, func(e bus.Event) error {
		out = append(out, e)
		return nil
	}); err != nil {
		tb.Fatalf("replay: %v", err)
	}
	return out
}
