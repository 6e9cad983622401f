package planner

import (
	"context"
	"fmt"
	"sync"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// gcReason is the retiring reason of an instance the garbage collector
// deletes.
const gcReason = "gc: orphaned instance"

// orphanKey names one instance on one target: "<entry>.<target>" and the
// instance name.
type orphanKey struct {
	target, instance string
}

// missing is when a proxy's instance was first found absent from the
// inventory of its target.
type missing struct {
	target string
	since  time.Time
}

// targetInventory is one agent's answer to an inventory request, indexed
// by instance name and by the proxy id of the marker, so that judging a
// target costs one lookup a proxy.
type targetInventory struct {
	entry, target string
	list          []agent.Instance
	names, ids    map[string]bool
}

func newTargetInventory(entry, target string, list []agent.Instance) targetInventory {
	ti := targetInventory{entry: entry, target: target, list: list,
		names: make(map[string]bool, len(list)), ids: make(map[string]bool, len(list))}
	for _, inst := range list {
		ti.names[inst.Name] = true
		ti.ids[inst.Marker.ProxyID] = true
	}
	return ti
}

// inventory is what one garbage-collection round gathered: the targets
// that answered, by "<entry>.<target>". Targets that did not answer are
// absent and change nothing.
type inventory struct {
	answered map[string]targetInventory
}

// orphan is a marked instance the collector deletes.
type orphan struct {
	entry, target string
	inst          agent.Instance
}

// gatherLoop asks every live agent for its inventory every GCInterval and
// hands the answers to the reconciler, which alone decides.
func (rc *reconciler) gatherLoop(ctx context.Context, out chan<- inventory) {
	t := time.NewTicker(rc.cfg.GCInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		in := rc.gather(ctx)
		select {
		case out <- in:
		case <-ctx.Done():
			return
		}
	}
}

// gather requests the inventories of the live agents concurrently.
func (rc *reconciler) gather(ctx context.Context) inventory {
	rc.mu.Lock()
	agents := rc.liveAgentsLocked(rc.now())
	rc.mu.Unlock()
	in := inventory{answered: map[string]targetInventory{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, a := range agents {
		wg.Go(func() {
			list, err := rc.requestInventory(ctx, a)
			if err != nil {
				if ctx.Err() == nil {
					rc.log.Warn("inventory request failed; target skipped this garbage-collection round",
						"entry", a.Entry, "target", a.Target, "err", err)
				}
				return
			}
			ti := newTargetInventory(a.Entry, a.Target, list)
			mu.Lock()
			in.answered[targetKey(a.Entry, a.Target)] = ti
			mu.Unlock()
		})
	}
	wg.Wait()
	return in
}

// isUp reports whether a proxy in state s has an instance its agent must
// list.
func isUp(s string) bool {
	return s == events.ProxyRunning || s == events.ProxyReady || s == events.ProxyUnhealthy
}

// collectGarbage judges one gathered inventory: marked instances of the
// target's own entry whose proxy is unknown or deleted, seen so for longer
// than GCGrace, are deleted; proxies that are up but whose instance has
// been missing from their answering target for longer than GCGrace fail
// with class vanished. Abandoned proxies' instances and unmarked instances
// are never touched. It runs on the reconciler goroutine.
func (rc *reconciler) collectGarbage(ctx context.Context, in inventory) {
	grace := rc.cfg.GCGrace
	var orphans []orphan
	var vanished []Proxy

	rc.mu.Lock()
	// Observations are dated when judged, against the state as it is now:
	// a proxy seen up now was up no earlier than this.
	now := rc.now()
	orphanNow := map[orphanKey]bool{}
	for tk, ti := range in.answered {
		for _, inst := range ti.list {
			id := inst.Marker.ProxyID
			if inst.Marker.Entry != ti.entry || !events.IsIdentifier(id) {
				continue // unmarked, or another entry's
			}
			if inst.Name != events.InstanceName(id) {
				rc.log.Warn("marked instance whose name does not derive from its proxy id; not touched",
					"entry", ti.entry, "target", ti.target, "instance", inst.Name, "proxy", id)
				continue
			}
			if rc.st.keepsInstance(id) {
				continue // live, being retired, or abandoned on purpose
			}
			k := orphanKey{target: tk, instance: inst.Name}
			orphanNow[k] = true
			since, ok := rc.orphanSince[k]
			if !ok {
				since = now
				rc.orphanSince[k] = since
				rc.log.Info("marked instance without a live proxy; deleting it after the grace period",
					"entry", ti.entry, "target", ti.target, "instance", inst.Name, "proxy", id, "grace", grace.String())
			}
			if now.Sub(since) > grace {
				orphans = append(orphans, orphan{entry: ti.entry, target: ti.target, inst: inst})
				// The agent gets a grace period to act before the
				// collector decides about this instance again.
				rc.orphanSince[k] = now
			}
		}
	}
	for k := range rc.orphanSince {
		if _, answered := in.answered[k.target]; answered && !orphanNow[k] {
			delete(rc.orphanSince, k)
		}
	}

	missingNow := map[string]bool{}
	for _, pl := range rc.st.pools {
		for _, x := range pl.members {
			if !isUp(x.State) {
				continue
			}
			tk := targetKey(x.Entry, x.Target)
			ti, answered := in.answered[tk]
			if !answered || ti.lists(*x) {
				continue
			}
			missingNow[x.ID] = true
			m, ok := rc.missingSince[x.ID]
			if !ok || m.target != tk {
				m = missing{target: tk, since: now}
				rc.missingSince[x.ID] = m
				rc.log.Warn("proxy's instance is missing from its target's inventory; failing it after the grace period",
					"proxy", x.ID, "entry", x.Entry, "target", x.Target, "instance", x.Instance, "grace", grace.String())
			}
			if now.Sub(m.since) > grace {
				vanished = append(vanished, *x)
			}
		}
	}
	for id, m := range rc.missingSince {
		x := rc.st.proxies[id]
		_, answered := in.answered[m.target]
		if x == nil || !isUp(x.State) || (answered && !missingNow[id]) {
			delete(rc.missingSince, id)
		}
	}
	rc.mu.Unlock()

	f := rc.flight(ctx)
	for _, o := range orphans {
		if ctx.Err() != nil {
			break
		}
		rc.deleteOrphan(ctx, f, o)
	}
	for _, x := range vanished {
		fd := events.ProxyFailedData{
			Class:   events.ClassVanished,
			Reason:  fmt.Sprintf("instance %s missing from the inventory of %s/%s for more than %s", x.Instance, x.Entry, x.Target, grace),
			Attempt: x.Attempt,
		}
		rc.decide(causedBy(ctx, x.traceparent), f, x, events.ProxyFailed, decisionID(x.ID, events.ProxyFailed, x.LastSeq, fd), fd, nil)
	}
	f.wait()
	if ctx.Err() == nil {
		rc.gcRounds.Add(1)
	}
}

// listed reports whether an inventory holds x's instance, by name or by
// the marker's proxy id.
func (ti targetInventory) lists(x Proxy) bool {
	return ti.names[x.Instance] || ti.ids[x.ID]
}

// deleteOrphan deletes one orphaned instance. It first appends retiring
// (reason gcReason) to the instance's proxy aggregate, expecting its last
// sequence: that gives the agent's deleted observation an aggregate to land
// on when the planner never knew the proxy, and it makes the agent act on a
// proxy whose last event was deleted (an agent drops deletes of finished
// proxies). The delete's attempt is the aggregate's number of retiring
// events, so repeating a round re-publishes the same Msg-Id (a no-op) and a
// new decision after a failed delete gets a new one. A proxy ever abandoned
// is left alone.
func (rc *reconciler) deleteOrphan(ctx context.Context, f *flight, o orphan) {
	id := o.inst.Marker.ProxyID
	log := rc.log.With("proxy", id, "entry", o.entry, "target", o.target, "instance", o.inst.Name)
	evs, err := rc.store.Load(ctx, events.AggregateProxy, id)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("garbage collection: read the proxy's events", "err", err)
		}
		return
	}
	var lastSeq uint64
	lastKind := ""
	retirings := 0
	for _, e := range evs {
		// The append below expects the aggregate's last sequence, whoever
		// wrote it; but an event from a writer not allowed to append its
		// type (an agent's abandoned), or an observation by an agent other
		// than the one holding the instance, decides nothing.
		lastSeq = e.Seq
		if events.CheckEvent(e.Aggregate, e.ID, e.Kind, e.Source, e.By) != nil || events.CheckPlacement(e.By, o.entry, o.target) != nil {
			continue
		}
		switch e.Kind {
		case events.ProxyAbandoned:
			return
		case events.ProxyRetiring:
			retirings++
		}
		lastKind = e.Kind
	}
	send := func(ctx context.Context, attempt int) {
		cmd := events.DeleteCommand{
			ProxyID: id, Pool: o.inst.Marker.Pool, Entry: o.entry, Target: o.target, Instance: o.inst.Name,
			ProviderID: o.inst.ProviderID, Attempt: attempt, Reason: gcReason,
		}
		f.command(ctx, pending{del: &cmd})
	}
	if lastKind == events.ProxyRetiring {
		send(ctx, retirings)
		return
	}
	d := events.ProxyRetiringData{Reason: gcReason}
	f.decide(ctx, nil, o.inst.Marker.Pool, events.AggregateProxy, id, &bus.Expect{Seq: lastSeq},
		[]bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(id, events.ProxyRetiring, lastSeq, d), Data: d}},
		[]any{"proxy", id, "decision", events.ProxyRetiring, "entry", o.entry, "target", o.target, "instance", o.inst.Name, "pool", o.inst.Marker.Pool, "why", gcReason},
		func(ctx context.Context, _ uint64) { send(ctx, retirings+1) })
}
