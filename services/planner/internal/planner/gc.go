package planner

import (
	"context"
	"fmt"
	"sync"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// gcReason is the retiring reason of an instance the garbage collector
// deletes.
const gcReason = "gc: orphaned instance"

// orphanKey and missing are the garbage collector's memory between
// rounds (the reconciler keeps it; [decide.GC] judges with it).
type (
	orphanKey = decide.OrphanKey
	missing   = decide.Missing
)

// inventory is what one garbage-collection round gathered: the targets
// that answered, by "<entry>.<target>". Targets that did not answer are
// absent and change nothing.
type inventory struct {
	answered map[string]decide.Inventory
	// seq is the sequence of the last event the state held when the
	// round asked for the inventories: a listing may predate any later
	// event (an agent's deleted while the answer was on its way).
	seq uint64
}

// newTargetInventory indexes one agent's answer to an inventory request.
func newTargetInventory(entry, target string, list []agent.Instance) decide.Inventory {
	insts := make([]decide.Instance, len(list))
	for i, inst := range list {
		insts[i] = decide.Instance{Name: inst.Name, ProviderID: inst.ProviderID,
			Proxy: inst.Marker.ProxyID, Pool: inst.Marker.Pool, Entry: inst.Marker.Entry}
	}
	return decide.NewInventory(entry, target, insts)
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
	seq := rc.st.seq
	rc.mu.Unlock()
	in := inventory{answered: map[string]decide.Inventory{}, seq: seq}
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

// collectGarbage judges one gathered inventory with [decide.GC]: marked
// instances of the target's own entry whose proxy is unknown or deleted,
// seen so for longer than GCGrace, are deleted; proxies that are up but
// whose instance has been missing from their answering target for longer
// than GCGrace fail with class vanished. Abandoned proxies' instances and
// unmarked instances are never touched. It runs on the reconciler
// goroutine.
func (rc *reconciler) collectGarbage(ctx context.Context, in inventory) {
	grace := rc.cfg.GCGrace
	var vanished []Proxy

	rc.mu.Lock()
	// Observations are dated when judged, against the state as it is now:
	// a proxy seen up now was up no earlier than this.
	v := decide.GC(decide.GCInput{
		Now: rc.now(), Grace: grace, Answered: in.answered,
		Keeps: rc.st.keepsInstance,
		Members: func(yield func(*decide.Proxy) bool) {
			for _, pl := range rc.st.pools {
				for _, x := range pl.members {
					if !yield(&x.Proxy) {
						return
					}
				}
			}
		},
		StateOf: func(id string) string {
			if x := rc.st.proxies[id]; x != nil {
				return x.State
			}
			return ""
		},
		Memory: decide.GCMemory{OrphanSince: rc.orphanSince, MissingSince: rc.missingSince},
	})
	rc.orphanSince, rc.missingSince = v.Memory.OrphanSince, v.Memory.MissingSince
	for _, x := range v.Vanished {
		vanished = append(vanished, *rc.st.proxies[x.ID])
	}
	rc.mu.Unlock()

	for _, o := range v.Misnamed {
		rc.log.Warn("marked instance whose name does not derive from its proxy id; not touched",
			"entry", o.Entry, "target", o.Target, "instance", o.Instance.Name, "proxy", o.Instance.Proxy)
	}
	for _, o := range v.NewOrphans {
		rc.log.Info("marked instance without a live proxy; deleting it after the grace period",
			"entry", o.Entry, "target", o.Target, "instance", o.Instance.Name, "proxy", o.Instance.Proxy, "grace", grace.String())
	}
	for _, x := range v.NewMissing {
		rc.log.Warn("proxy's instance is missing from its target's inventory; failing it after the grace period",
			"proxy", x.ID, "entry", x.Entry, "target", x.Target, "instance", x.Instance, "grace", grace.String())
	}

	f := rc.flight(ctx)
	for _, o := range v.Orphans {
		if ctx.Err() != nil {
			break
		}
		rc.deleteOrphan(ctx, f, o, in.seq)
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

// factsOf is what [decide.DeleteInstance] reads of a proxy's events.
func factsOf(evs []bus.Event) []decide.Fact {
	facts := make([]decide.Fact, len(evs))
	for i, e := range evs {
		facts[i] = decide.Fact{Seq: e.Seq, Aggregate: e.Aggregate, ID: e.ID, Kind: e.Kind, Source: e.Source, By: e.By, Unreadable: e.Unreadable != nil}
	}
	return facts
}

// deleteOrphan deletes one orphaned instance as [decide.DeleteOrphan]
// says: it first appends retiring (reason gcReason) to the instance's
// proxy aggregate, unless the proxy's last event is a retiring already,
// then sends the delete. A proxy ever abandoned is left alone, and one
// with an event after listedAt waits for the next round's inventory.
func (rc *reconciler) deleteOrphan(ctx context.Context, f *flight, o decide.Orphan, listedAt uint64) {
	id := o.Instance.Proxy
	log := rc.log.With("proxy", id, "entry", o.Entry, "target", o.Target, "instance", o.Instance.Name)
	evs, err := rc.store.Load(ctx, events.AggregateProxy, id)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("garbage collection: read the proxy's events", "err", err)
		}
		return
	}
	od := decide.DeleteOrphan(o, factsOf(evs), listedAt)
	if od.Stale {
		log.Debug("garbage collection: the proxy has an event newer than the inventory; judged again next round",
			"last_seq", od.LastSeq, "listed_at", listedAt)
		return
	}
	if od.Skip {
		return
	}
	send := func(ctx context.Context) {
		cmd := events.DeleteCommand{
			ProxyID: id, Pool: o.Instance.Pool, Entry: o.Entry, Target: o.Target, Instance: o.Instance.Name,
			ProviderID: o.Instance.ProviderID, Attempt: od.Attempt, Reason: gcReason,
		}
		f.command(ctx, pending{del: &cmd})
	}
	if !od.Retire {
		send(ctx)
		return
	}
	d := events.ProxyRetiringData{Reason: gcReason}
	f.decide(ctx, nil, o.Instance.Pool, events.AggregateProxy, id, &bus.Expect{Seq: od.LastSeq},
		[]bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(id, events.ProxyRetiring, od.LastSeq, d), Data: d}},
		[]any{"proxy", id, "decision", events.ProxyRetiring, "entry", o.Entry, "target", o.Target, "instance", o.Instance.Name, "pool", o.Instance.Pool, "why", gcReason},
		func(ctx context.Context, _ uint64) { send(ctx) })
}
