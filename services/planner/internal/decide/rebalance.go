package decide

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"

	"proxyfleet/pkg/events"
)

// RebalancePrefix starts the replace reason of a proxy requested to move
// a pool toward its placement; like a roll step it holds the pool's one
// surge slot ([HoldsSurge]).
const RebalancePrefix = "rebalance: "

// Shares is each weighted value's share of size proxies: its exact share
// size·weight/sum rounded by largest remainder. Every value gets the whole
// part of its exact share, and the proxies left over go one each to the
// values with the largest fractional parts (ties: the larger weight, then
// the value name first). The shares sum to size, so a pool can be exactly
// on share: 10 over 50/30/20 is 5/3/2, 3 over 80/20 is 2/1.
func Shares(size int, weights map[string]int) map[string]int {
	var sum int64
	for _, w := range weights {
		sum += int64(w)
	}
	out := make(map[string]int, len(weights))
	if sum <= 0 {
		return out
	}
	type rest struct {
		value string
		rem   int64
		w     int
	}
	rests := make([]rest, 0, len(weights))
	left := size
	for v, w := range weights {
		q := int64(size) * int64(w)
		out[v] = int(q / sum)
		left -= out[v]
		rests = append(rests, rest{v, q % sum, w})
	}
	sort.Slice(rests, func(i, j int) bool {
		a, b := rests[i], rests[j]
		if a.rem != b.rem {
			return a.rem > b.rem
		}
		if a.w != b.w {
			return a.w > b.w
		}
		return a.value < b.value
	})
	for i := 0; i < left && i < len(rests); i++ {
		out[rests[i].value]++
	}
	return out
}

// liveLabels maps each live target's key to its labels.
func (pl *Placement) liveLabels() map[string]map[string]string {
	out := make(map[string]map[string]string, len(pl.Targets))
	for _, a := range pl.Targets {
		out[a.Key()] = a.Labels
	}
	return out
}

// labelsOf is the labels proxy x counts by: its target's while the target
// is alive, else those recorded on x when it was placed.
func labelsOf(live map[string]map[string]string, x Proxy) map[string]string {
	if l, ok := live[TargetKey(x.Entry, x.Target)]; ok {
		return l
	}
	return x.Labels
}

// spreadCountsOf counts proxies xs per value of each of the pool's
// spreads, by [labelsOf], plus one for each target of extra.
func spreadCountsOf(pool *Pool, live map[string]map[string]string, xs []Proxy, extra []Target) []map[string]int {
	p := pool.Spec.Placement
	out := make([]map[string]int, len(p.Spread))
	for i := range out {
		out[i] = map[string]int{}
	}
	add := func(labels map[string]string) {
		for i, s := range p.Spread {
			if v, ok := labels[s.Label]; ok {
				out[i][v]++
			}
		}
	}
	for _, x := range xs {
		add(labelsOf(live, x))
	}
	for _, a := range extra {
		add(a.Labels)
	}
	return out
}

// misplaced says why proxy x, whose labels are labels, sits where the
// pool's placement no longer puts proxies: on an entry the pool no longer
// lists, on labels its require excludes, or on a value no spread weighs.
// "" when it is where the placement accepts it.
func misplaced(pool *Pool, labels map[string]string, x Proxy) string {
	if !slices.Contains(pool.Spec.PlacementEntries(), x.Entry) {
		return fmt.Sprintf("entry %s is not one of the pool's entries (%s)", x.Entry, strings.Join(pool.Spec.PlacementEntries(), ", "))
	}
	p := pool.Spec.Placement
	for _, k := range slices.Sorted(maps.Keys(p.Require)) {
		if v, ok := labels[k]; !ok {
			return fmt.Sprintf("its target has no %s label, placement.require asks for %s", k, strings.Join(p.Require[k], ", "))
		} else if !slices.Contains(p.Require[k], v) {
			return fmt.Sprintf("%s=%s is not in placement.require (%s in [%s])", k, v, k, strings.Join(p.Require[k], ", "))
		}
	}
	for _, s := range p.Spread {
		if v, ok := labels[s.Label]; !ok {
			return fmt.Sprintf("its target has no %s label, which the spread weighs", s.Label)
		} else if _, weighed := s.Weights[v]; !weighed {
			return fmt.Sprintf("%s=%s has no weight in the spread", s.Label, v)
		}
	}
	return ""
}

// weightSum is the sum of s's weights.
func weightSum(s events.Spread) int64 {
	var sum int64
	for _, w := range s.Weights {
		sum += int64(w)
	}
	return sum
}

// rebalance moves one proxy of a pool with a placement toward it, surge
// first like a roll step: it requests a new proxy replacing a member that
// sits where the placement no longer puts proxies ([misplaced]) or on a
// value holding more than its share ([Shares]), and the member is retired
// once the new one is ready. Only when the pool is at size with nothing
// else in flight: no member condemned (no roll, rotation, replacement or
// earlier rebalance under way), no create decided this round, no miss. So
// one rebalance at a time, and the pool never holds more than size+1
// active proxies for it.
//
// Misplaced members move first, to wherever [Place] puts a new proxy.
// Then the spreads, the first deciding first: a member of the value most
// over its share (the largest count above its share; ties: the larger
// weighted surplus, then the value name) moves to a target whose value is
// under its share, the one furthest below first, and only when the move
// brings the two closer to their exact shares (their weighted surpluses
// differ by more than one proxy), so a spread met within rounding never
// moves. For a later spread, only to a target with the member's values of
// the earlier ones, so it never undoes them. Of a value's members, the
// unhealthy first, then the oldest ([SickFirst]): the one that has served
// longest and is nearest its rotation, as a scale-down and a roll pick.
func (c *pass) rebalance() {
	pool := &c.in.Pool
	p := pool.Spec.Placement
	if p == nil || c.want <= 0 || len(c.found.Condemned) > 0 || len(c.found.Counted) != c.want || c.found.Miss != nil {
		return
	}
	for _, d := range c.plan.Decisions {
		if d.Kind == Create {
			return
		}
	}
	var open []Target
	for _, a := range c.pl.Targets {
		if c.pl.Offers(pool, a) {
			open = append(open, a)
		}
	}
	if len(open) == 0 {
		return
	}
	live := c.pl.liveLabels()
	order := slices.Clone(c.found.Counted)
	SickFirst(order)
	for _, x := range order {
		if why := misplaced(pool, labelsOf(live, x), x); why != "" {
			c.pl.Leave(x)
			if a, ok := Place(c.pl, pool); ok {
				c.move(x, a, RebalancePrefix+why)
			}
			return
		}
	}
	counts := spreadCountsOf(pool, live, c.found.Counted, nil)
	size := int64(c.want)
	for i, s := range p.Spread {
		sum := weightSum(s)
		shares := Shares(c.want, s.Weights)
		surplus := func(v string) int64 { return int64(counts[i][v])*sum - size*int64(s.Weights[v]) }
		var over []string
		for _, v := range slices.Sorted(maps.Keys(s.Weights)) {
			if counts[i][v] > shares[v] {
				over = append(over, v)
			}
		}
		sort.SliceStable(over, func(a, b int) bool {
			ea, eb := counts[i][over[a]]-shares[over[a]], counts[i][over[b]]-shares[over[b]]
			if ea != eb {
				return ea > eb
			}
			return surplus(over[a]) > surplus(over[b])
		})
		for _, o := range over {
			// Where a member may go depends only on its values of the
			// earlier spreads: each is tried once, not once per member.
			tried := map[string]bool{}
			for _, x := range order {
				xl := labelsOf(live, x)
				if xl[s.Label] != o {
					continue
				}
				var key strings.Builder
				for _, e := range p.Spread[:i] {
					key.WriteString(xl[e.Label] + "\x00")
				}
				if tried[key.String()] {
					continue
				}
				tried[key.String()] = true
				var to []Target
				for _, a := range open {
					u, ok := a.Labels[s.Label]
					if !ok || counts[i][u] >= shares[u] || surplus(o)-surplus(u) <= sum {
						continue
					}
					same := true
					for _, e := range p.Spread[:i] {
						same = same && a.Labels[e.Label] == xl[e.Label]
					}
					if same {
						to = append(to, a)
					}
				}
				if len(to) == 0 {
					continue
				}
				sub := *c.pl
				sub.Targets = to
				a, ok := Place(&sub, pool)
				if !ok {
					continue
				}
				u := a.Labels[s.Label]
				c.move(x, a, fmt.Sprintf("%s%s=%s holds %d of %d, its share is %d; %s=%s holds %d, its share is %d",
					RebalancePrefix, s.Label, o, counts[i][o], c.want, shares[o], s.Label, u, counts[i][u], shares[u]))
				return
			}
		}
	}
}

// move requests a new proxy on target a replacing member x, for why.
func (c *pass) move(x Proxy, a Target, why string) {
	c.pl.Leave(x)
	c.pl.count(a.Key(), 1)
	c.add(Decision{Kind: Create, Proxy: x, Target: a, Reason: why, Note: "moving a proxy toward the pool's placement: replacement first"})
}

// spreadShort explains, for each spread, the values holding fewer than
// their share ([Shares] of the pool's size) with counts (per spread, as
// [spreadCountsOf] gives them) that no live target can take a proxy of
// now: "region=ap has 0 of its share 2: no live target with region=ap".
// Values a target can take are not named: the fill or a rebalance puts
// proxies there. "" when none.
func (pl *Placement) spreadShort(pool *Pool, counts []map[string]int) string {
	p := pool.Spec.Placement
	if p == nil || len(counts) != len(p.Spread) {
		return ""
	}
	var parts []string
	for i, s := range p.Spread {
		shares := Shares(pool.Size(), s.Weights)
		for _, v := range slices.Sorted(maps.Keys(s.Weights)) {
			if counts[i][v] >= shares[v] {
				continue
			}
			if why := pl.valueBlocked(pool, s.Label, v); why != "" {
				parts = append(parts, fmt.Sprintf("%s=%s has %d of its share %d: %s", s.Label, v, counts[i][v], shares[v], why))
			}
		}
	}
	return strings.Join(parts, "; ")
}

// valueBlocked says why no live target with label=value can take a new
// proxy of pool now; "" when one can.
func (pl *Placement) valueBlocked(pool *Pool, label, value string) string {
	lv := label + "=" + value
	var with []Target
	for _, a := range pl.Targets {
		if Eligible(pool, a) && a.Labels[label] == value {
			if pl.Offers(pool, a) {
				return ""
			}
			with = append(with, a)
		}
	}
	if len(with) == 0 {
		return "no live target with " + lv
	}
	if img := pool.Spec.Image; img != "" {
		of := func(a Target) []string { return a.Images }
		if with = offering(with, img, of); len(with) == 0 {
			return fmt.Sprintf("no live target with %s offers image %s", lv, img)
		}
	}
	if prof := pool.Spec.Profile; prof != "" {
		of := func(a Target) []string { return a.Profiles }
		if with = offering(with, prof, of); len(with) == 0 {
			return fmt.Sprintf("no live target with %s offers profile %s", lv, prof)
		}
	}
	var accepted []Target
	for _, a := range with {
		if Labelled(pool, a) {
			accepted = append(accepted, a)
		}
	}
	if len(accepted) == 0 {
		return fmt.Sprintf("no live target with %s carries the rest of the labels the placement asks for", lv)
	}
	var full, failing, avoided []string
	for _, a := range accepted {
		k := a.Key()
		switch {
		case a.Capacity > 0 && pl.Load.All[k] >= a.Capacity:
			full = append(full, fmt.Sprintf("%s (%d of %d)", a.Target, pl.Load.All[k], a.Capacity))
		case pl.Failing(a):
			failing = append(failing, fmt.Sprintf("%s (%s)", a.Target, JoinNames(a.Check.Failing)))
		default:
			avoided = append(avoided, fmt.Sprintf("%s (%s)", a.Target, pl.Avoid[k].Class))
		}
	}
	var why []string
	if len(full) > 0 {
		why = append(why, "its targets are at capacity: "+JoinNames(full))
	}
	if len(failing) > 0 {
		why = append(why, "its targets fail their checks: "+JoinNames(failing))
	}
	if len(avoided) > 0 {
		why = append(why, "its targets failed recently: "+JoinNames(avoided))
	}
	return strings.Join(why, ", ")
}
