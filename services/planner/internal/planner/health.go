package planner

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/services/planner/internal/decide"
)

// healthBook is what the planner knows of the health replicas: each one
// renews a key of its own in fleet-health, which expires after
// bus.HealthMemberTTL (see services/health/internal/probe/members.go).
// Only health probes proxies, so while no replica is alive the planner
// cannot tell a proxy that never got ready from one nobody looked at.
// Guarded by [Planner.mu].
type healthBook struct {
	// started is when the planner began watching fleet-health: it says
	// nothing of health before a membership TTL has passed since, so a
	// planner that starts does not call health down before it had a
	// chance to see a replica's key.
	started time.Time
	// last maps a member key to its last renewal (server time).
	last map[string]time.Time
	// gone is the latest time a replica was known alive: its last renewal
	// plus the TTL when it expired, or when it deleted its key.
	gone time.Time
	// downSince is when health went down, zero while it is not.
	downSince time.Time
	// back is when health last came back after being down.
	back time.Time
	// checks holds each target's latest check verdict from
	// fleet-targets, by "<entry>.<target>" (targetchecks.go).
	checks map[string]*decide.Check
}

// healthTTL is how long a health replica's key lives: the planner's
// start-up grace, and how long a replica counts as alive after renewing.
const healthTTL = bus.HealthMemberTTL

// healthLocked returns what the rules know of health at now, and notes a
// transition (down, or back) in the book. Callers hold p.mu.
func (p *Planner) healthLocked(now time.Time) decide.Health {
	b := &p.health
	alive := false
	for k, at := range b.last {
		if now.Sub(at) < healthTTL {
			alive = true
			continue
		}
		// Expired: the bucket's TTL leaves no marker to watch.
		if end := at.Add(healthTTL); end.After(b.gone) {
			b.gone = end
		}
		delete(b.last, k)
	}
	switch {
	case alive:
		if !b.downSince.IsZero() {
			p.log.Info("a health replica is alive again; ready timeouts count from now", "downSince", b.downSince)
			b.downSince, b.back = time.Time{}, now
		}
	case b.started.IsZero() || now.Sub(b.started) < healthTTL:
		// Too early to tell.
	case b.downSince.IsZero():
		b.downSince = b.started
		if b.gone.After(b.downSince) {
			b.downSince = b.gone
		}
		p.log.Warn("no health replica is alive: pools' readiness is unknown and running proxies are not failed for want of a probe until one is",
			"since", b.downSince)
	}
	return decide.Health{Down: !b.downSince.IsZero(), Since: b.downSince, Back: b.back}
}

func (p *Planner) onHealthMember(e jetstream.KeyValueEntry) {
	// Times are the planner's own, when it learned of the change, not the
	// server's stamp: a clock of this host that runs a few seconds ahead
	// of the server's would otherwise see every renewal as expired (the
	// TTL is 3 s). A key the watch delivers is in the bucket, so alive
	// for at most one TTL more. (The wall clock, as the server's stamp
	// was: tests move the planner's clocks, not the replicas' renewals.)
	now := time.Now()
	p.mu.Lock()
	wasDown := !p.health.downSince.IsZero()
	if e.Operation() == jetstream.KeyValuePut {
		p.health.last[e.Key()] = now
	} else {
		// A replica that leaves cleanly deletes its key.
		delete(p.health.last, e.Key())
		if now.After(p.health.gone) {
			p.health.gone = now
		}
	}
	p.mu.Unlock()
	if wasDown && p.caughtUp.Load() {
		p.poke()
	}
}
