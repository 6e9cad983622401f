package decide

import (
	"iter"
	"maps"
	"time"

	"proxyfleet/pkg/events"
)

// Instance is one marked instance as an agent's inventory lists it.
type Instance struct {
	Name, ProviderID string
	// Proxy, Pool and Entry are the marker's: the proxy the instance was
	// created for, its pool and the entry that created it.
	Proxy, Pool, Entry string
}

// Inventory is one target's answer to an inventory request, indexed by
// instance name and by the marker's proxy id, so that judging a target
// costs one lookup a proxy. Build it with [NewInventory].
type Inventory struct {
	Entry, Target string
	Instances     []Instance
	names, ids    map[string]bool
}

// NewInventory indexes the instances target target of entry entry listed.
func NewInventory(entry, target string, list []Instance) Inventory {
	in := Inventory{Entry: entry, Target: target, Instances: list,
		names: make(map[string]bool, len(list)), ids: make(map[string]bool, len(list))}
	for _, inst := range list {
		in.names[inst.Name] = true
		in.ids[inst.Proxy] = true
	}
	return in
}

// Lists reports whether the inventory holds x's instance, by name or by
// the marker's proxy id.
func (in Inventory) Lists(x Proxy) bool {
	return in.names[x.Instance] || in.ids[x.ID]
}

// OrphanKey names one instance on one target: "<entry>.<target>" and the
// instance name.
type OrphanKey struct {
	Target, Instance string
}

// Missing is when a proxy's instance was first found absent from the
// inventory of its target ("<entry>.<target>").
type Missing struct {
	Target string
	Since  time.Time
}

// GCMemory is what the garbage collector remembers between rounds: since
// when each orphan has been seen, and since when each up proxy's instance
// has been missing.
type GCMemory struct {
	OrphanSince  map[OrphanKey]time.Time
	MissingSince map[string]Missing
}

// GCInput is what one garbage-collection round judges.
type GCInput struct {
	// Now dates the round's observations.
	Now time.Time
	// Grace is how long an orphan must be seen, or an up proxy's instance
	// missing, before the collector acts.
	Grace time.Duration
	// Answered are the inventories of the targets that answered, by
	// "<entry>.<target>"; a target that did not answer changes nothing.
	Answered map[string]Inventory
	// Keeps reports whether the state keeps proxy id's instance: the
	// proxy is live, being retired, or was abandoned on purpose.
	Keeps func(id string) bool
	// Members are the pools' members.
	Members iter.Seq[*Proxy]
	// StateOf is proxy id's state, "" for a proxy the state does not hold.
	StateOf func(id string) string
	// Memory is the collector's memory after the round before.
	Memory GCMemory
}

// Orphan is a marked instance on one target.
type Orphan struct {
	Entry, Target string
	Instance      Instance
}

// GCVerdict is what one garbage-collection round decided and noticed.
type GCVerdict struct {
	// Orphans are deleted: marked instances of the target's own entry
	// whose proxy the state does not keep, seen so for longer than the
	// grace period.
	Orphans []Orphan
	// Vanished fail with class vanished: up proxies whose instance has
	// been missing from their answering target for longer than the grace
	// period.
	Vanished []Proxy
	// Misnamed are marked instances whose name does not derive from their
	// proxy id: never touched.
	Misnamed []Orphan
	// NewOrphans are the orphans first seen this round, NewMissing the
	// proxies first found missing this round.
	NewOrphans []Orphan
	NewMissing []Proxy
	// Memory is the collector's memory for the next round.
	Memory GCMemory
}

// IsUp reports whether a proxy in state s has an instance its agent must
// list.
func IsUp(s string) bool {
	return s == events.ProxyRunning || s == events.ProxyReady || s == events.ProxyUnhealthy
}

// GC judges one gathered inventory. Unmarked instances, another entry's,
// and the instances of proxies the state keeps (abandoned ones included)
// are never touched. An orphan deleted is seen afresh: the agent gets a
// grace period to act before the collector decides about it again. What
// an answering target no longer lists, or no longer misses, is forgotten;
// what a silent target listed is remembered.
func GC(in GCInput) GCVerdict {
	v := GCVerdict{Memory: GCMemory{OrphanSince: maps.Clone(in.Memory.OrphanSince), MissingSince: maps.Clone(in.Memory.MissingSince)}}
	if v.Memory.OrphanSince == nil {
		v.Memory.OrphanSince = map[OrphanKey]time.Time{}
	}
	if v.Memory.MissingSince == nil {
		v.Memory.MissingSince = map[string]Missing{}
	}
	orphanNow := map[OrphanKey]bool{}
	for tk, ti := range in.Answered {
		for _, inst := range ti.Instances {
			id := inst.Proxy
			if inst.Entry != ti.Entry || !events.IsIdentifier(id) {
				continue // unmarked, or another entry's
			}
			o := Orphan{Entry: ti.Entry, Target: ti.Target, Instance: inst}
			if inst.Name != events.InstanceName(id) {
				v.Misnamed = append(v.Misnamed, o)
				continue
			}
			if in.Keeps(id) {
				continue // live, being retired, or abandoned on purpose
			}
			k := OrphanKey{Target: tk, Instance: inst.Name}
			orphanNow[k] = true
			since, ok := v.Memory.OrphanSince[k]
			if !ok {
				since = in.Now
				v.Memory.OrphanSince[k] = since
				v.NewOrphans = append(v.NewOrphans, o)
			}
			if in.Now.Sub(since) > in.Grace {
				v.Orphans = append(v.Orphans, o)
				v.Memory.OrphanSince[k] = in.Now
			}
		}
	}
	for k := range v.Memory.OrphanSince {
		if _, answered := in.Answered[k.Target]; answered && !orphanNow[k] {
			delete(v.Memory.OrphanSince, k)
		}
	}

	missingNow := map[string]bool{}
	for x := range in.Members {
		if !IsUp(x.State) {
			continue
		}
		tk := TargetKey(x.Entry, x.Target)
		ti, answered := in.Answered[tk]
		if !answered || ti.Lists(*x) {
			continue
		}
		missingNow[x.ID] = true
		m, ok := v.Memory.MissingSince[x.ID]
		if !ok || m.Target != tk {
			m = Missing{Target: tk, Since: in.Now}
			v.Memory.MissingSince[x.ID] = m
			v.NewMissing = append(v.NewMissing, *x)
		}
		if in.Now.Sub(m.Since) > in.Grace {
			v.Vanished = append(v.Vanished, *x)
		}
	}
	for id, m := range v.Memory.MissingSince {
		_, answered := in.Answered[m.Target]
		if !IsUp(in.StateOf(id)) || (answered && !missingNow[id]) {
			delete(v.Memory.MissingSince, id)
		}
	}
	return v
}

// Fact is one event of a proxy's aggregate as the collector reads it.
type Fact struct {
	Seq                         uint64
	Aggregate, ID, Kind, Source string
	// By is the agent the event's subject names (zero for a decision).
	By events.Observer
	// Unreadable: the message's envelope does not decode; only its
	// position is known.
	Unreadable bool
}

// OrphanDelete is how an orphan is deleted, from its proxy's events.
type OrphanDelete struct {
	// Skip: the proxy was abandoned once; its instance is never touched.
	Skip bool
	// Stale: the proxy's aggregate moved on after the inventory was
	// requested (an agent's deleted, say, while the listing was on its
	// way), so the listing may predate it; nothing is decided this round,
	// and the next round's inventory judges the instance again.
	Stale bool
	// Retire: append retiring expecting the aggregate's LastSeq (that
	// gives the agent's deleted observation an aggregate to land on when
	// the planner never knew the proxy, and it makes the agent act on a
	// proxy whose last event was deleted); otherwise the proxy's last
	// event is a retiring already and only the delete is sent again.
	Retire  bool
	LastSeq uint64
	// Attempt is the delete's attempt: the aggregate's number of retiring
	// events, counting the one Retire appends. So repeating a round
	// re-publishes the same Msg-Id (a no-op) and a new decision after a
	// failed delete gets a new one.
	Attempt int
}

// DeleteOrphan decides how orphan o is deleted from the events of its
// proxy's aggregate, in order (see [DeleteInstance]); a proxy ever
// abandoned is skipped. listedAt is the sequence of the last event the
// state held when the round asked for the inventory: an aggregate with a
// later event is stale and decides nothing.
func DeleteOrphan(o Orphan, evs []Fact, listedAt uint64) OrphanDelete {
	if n := len(evs); n > 0 && evs[n-1].Seq > listedAt {
		return OrphanDelete{Stale: true, LastSeq: evs[n-1].Seq}
	}
	d, abandoned := DeleteInstance(o.Entry, o.Target, evs)
	if abandoned {
		return OrphanDelete{Skip: true}
	}
	return d
}

// DeleteInstance decides how the instance on entry/target of a proxy is deleted
// again, from the events of the proxy's aggregate, in order: the
// collector's orphans and the operator's instance.delete. The append
// expects the aggregate's last sequence, whoever wrote it; but an
// unreadable event, an event from a writer not allowed to append its type
// (an agent's abandoned), or an observation by an agent other than the
// one holding the instance, decides nothing. abandoned reports whether
// the proxy was ever abandoned: the collector then leaves its instance
// alone, the operator's request deletes it all the same.
func DeleteInstance(entry, target string, evs []Fact) (d OrphanDelete, abandoned bool) {
	lastKind := ""
	retirings := 0
	for _, e := range evs {
		d.LastSeq = e.Seq
		if e.Unreadable || events.CheckEvent(e.Aggregate, e.ID, e.Kind, e.Source, e.By) != nil || events.CheckPlacement(e.By, entry, target) != nil {
			continue
		}
		switch e.Kind {
		case events.ProxyAbandoned:
			abandoned = true
		case events.ProxyRetiring:
			retirings++
		}
		lastKind = e.Kind
	}
	if lastKind == events.ProxyRetiring {
		d.Attempt = retirings
		return d, abandoned
	}
	d.Retire, d.Attempt = true, retirings+1
	return d, abandoned
}
