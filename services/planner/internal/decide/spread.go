package decide

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"proxyfleet/pkg/events"
)

// Record notes the labels the pool's members carry, per target, so a
// spread counts the proxies on a target that is no longer alive by the
// labels recorded on them (a live target's proxies count by its labels).
func (pl *Placement) Record(members []Proxy) {
	for _, x := range members {
		if len(x.Labels) == 0 || !IsActive(x.State) {
			continue
		}
		if pl.recorded == nil {
			pl.recorded = map[string]map[string]string{}
		}
		pl.recorded[TargetKey(x.Entry, x.Target)] = x.Labels
	}
}

// Leave counts member x out of the spread: it is being replaced. Once
// per member.
func (pl *Placement) Leave(x Proxy) {
	if x.ID == "" || pl.leavingID[x.ID] || !IsActive(x.State) {
		return
	}
	if pl.leaving == nil {
		pl.leaving, pl.leavingID = map[string]int{}, map[string]bool{}
	}
	pl.leavingID[x.ID] = true
	pl.leaving[TargetKey(x.Entry, x.Target)]++
}

// unleave undoes [Placement.Leave] for x, which is retired now (and so
// counted out of the load itself).
func (pl *Placement) unleave(x Proxy) {
	if pl.leavingID[x.ID] {
		delete(pl.leavingID, x.ID)
		pl.leaving[TargetKey(x.Entry, x.Target)]--
	}
}

// Labelled reports whether target a's labels let it take the pool's
// proxies: they satisfy the placement's require, and carry a value each
// spread weighs.
func Labelled(pool *Pool, a Target) bool {
	p := pool.Spec.Placement
	if p == nil {
		return true
	}
	if !p.Matches(a.Labels) {
		return false
	}
	for _, s := range p.Spread {
		if _, ok := s.Weights[a.Labels[s.Label]]; !ok {
			return false
		}
	}
	return true
}

// spreadCounts counts the pool's active proxies per value of each spread
// label, less those being replaced ([Placement.Leave]): by the labels of
// their target when it is alive, else by those recorded on them
// ([Placement.Record]).
func (pl *Placement) spreadCounts(pool *Pool) []map[string]int {
	p := pool.Spec.Placement
	if p == nil || len(p.Spread) == 0 {
		return nil
	}
	live := make(map[string]map[string]string, len(pl.Targets))
	for _, a := range pl.Targets {
		live[a.Key()] = a.Labels
	}
	out := make([]map[string]int, len(p.Spread))
	for i := range out {
		out[i] = map[string]int{}
	}
	for k, n := range pl.Load.Pool {
		if n -= pl.leaving[k]; n <= 0 {
			continue
		}
		labels, ok := live[k]
		if !ok {
			labels = pl.recorded[k]
		}
		for i, s := range p.Spread {
			if v, ok := labels[s.Label]; ok {
				out[i][v] += n
			}
		}
	}
	return out
}

// deficits is how far below its weighted share of size each spread's
// value of target a is, scaled by the sum of the spread's weights so it
// stays whole: size·weight − count·sum.
func deficits(pool *Pool, counts []map[string]int, a Target) []int64 {
	p := pool.Spec.Placement
	out := make([]int64, len(p.Spread))
	size := int64(pool.Size())
	for i, s := range p.Spread {
		var sum int64
		for _, w := range s.Weights {
			sum += int64(w)
		}
		v := a.Labels[s.Label]
		out[i] = size*int64(s.Weights[v]) - int64(counts[i][v])*sum
	}
	return out
}

// compareDeficits orders deficit vectors, the first spread deciding
// first: positive when a is further below its shares than b.
func compareDeficits(a, b []int64) int {
	for i := range a {
		switch {
		case a[i] > b[i]:
			return 1
		case a[i] < b[i]:
			return -1
		}
	}
	return 0
}

// labelMiss explains why no live target of live (those offering the
// pool's image and profile) carries the labels the pool's placement asks
// for; ok is false when some do, and those are returned.
func labelMiss(pool *Pool, live []Target) (matching []Target, m Miss, ok bool) {
	p := pool.Spec.Placement
	if p == nil {
		return live, Miss{}, false
	}
	for _, a := range live {
		if Labelled(pool, a) {
			matching = append(matching, a)
		}
	}
	if len(matching) > 0 {
		return matching, Miss{}, false
	}
	var want []string
	for _, k := range slices.Sorted(maps.Keys(p.Require)) {
		want = append(want, k+" in ["+strings.Join(p.Require[k], ", ")+"]")
	}
	for _, s := range p.Spread {
		want = append(want, s.Label+" in ["+strings.Join(slices.Sorted(maps.Keys(s.Weights)), ", ")+"] (spread)")
	}
	parts := make([]string, 0, len(live))
	for _, a := range live {
		parts = append(parts, targetName(pool, a)+" ("+labelText(a.Labels)+")")
	}
	return nil, Miss{Reason: events.ReasonNoTargetMatchesLabels,
		Message: fmt.Sprintf("no live target of %s that offers the pool's image and profile carries the labels its placement asks for: %s; considered: %s",
			entriesText(pool), strings.Join(want, ", "), JoinNames(parts))}, true
}

// spreadNote is the part of a miss's message naming the spread values
// short of their share that no live target can take a proxy of
// ([Placement.spreadShort]); "" when none.
func (pl *Placement) spreadNote(pool *Pool) string {
	if pool.Spec.Placement == nil || len(pool.Spec.Placement.Spread) == 0 {
		return ""
	}
	if short := pl.spreadShort(pool, pl.spreadCounts(pool)); short != "" {
		return "; spread: " + short
	}
	return ""
}

// labelText shows labels as "k=v, k=v", or "no labels".
func labelText(labels map[string]string) string {
	if len(labels) == 0 {
		return "no labels"
	}
	parts := make([]string, 0, len(labels))
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		parts = append(parts, k+"="+labels[k])
	}
	return strings.Join(parts, ", ")
}
