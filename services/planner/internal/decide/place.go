package decide

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"proxyfleet/pkg/events"
)

// Placement is what placing a proxy reads besides the pool: the live
// targets (in key order), their load and recent failures.
type Placement struct {
	Now     time.Time
	Targets []Target
	Load    Load
	Avoid   map[string]Avoidance
	// Known names the targets ever known for the pool's entries (from
	// heartbeats or events; "<entry>/<target>" over several entries),
	// for the message when none is alive.
	Known []string
	// QuotaAvoid is [Config.QuotaAvoid].
	QuotaAvoid time.Duration
	// CheckMaxAge is how old a target's failed check may be and still
	// keep new proxies off it; 0: checks never do (see [Placement.Failing]).
	CheckMaxAge time.Duration

	// recorded holds the labels the pool's proxies carry per target key
	// (see [Placement.Record]).
	recorded map[string]map[string]string
	// leaving counts, per target key, the pool's members being replaced
	// (condemned, or named by a replacement decided in this pass): a
	// spread counts them out, so a replacement goes to the value its
	// member leaves rather than the one that looks emptiest with it.
	leaving   map[string]int
	leavingID map[string]bool
}

// Failing reports whether target a's latest check failed recently enough
// to keep new proxies off it. A check older than CheckMaxAge, or none at
// all, does not: health may be down or may not have polled the target
// yet, and placement must not stop with it.
func (pl *Placement) Failing(a Target) bool {
	c := a.Check
	return c != nil && !c.OK && pl.Now.Sub(c.At) < pl.CheckMaxAge
}

// Place picks the target for one new proxy of pool: a live target of one
// of the pool's entries ([Eligible]) (and of its spec's targets when set) offering its image and
// profile, whose labels its placement accepts ([Labelled]), with capacity
// left, no recently failed check and no recent quota failure or stuck
// create. With a spread, the target whose label value is furthest below
// its weighted share of the pool's size first (the first spread deciding
// first); then fewest proxies of this pool, then fewest overall, then by
// name.
func Place(pl *Placement, pool *Pool) (Target, bool) {
	var best Target
	found := false
	var bestPool, bestAll int
	var bestDef []int64
	counts := pl.spreadCounts(pool)
	for _, a := range pl.Targets {
		if !pl.Offers(pool, a) {
			continue
		}
		k := a.Key()
		np, na := pl.Load.Pool[k], pl.Load.All[k]
		var def []int64
		cmp := 0
		if counts != nil {
			def = deficits(pool, counts, a)
			if found {
				cmp = compareDeficits(def, bestDef)
			}
		}
		if !found || cmp > 0 || (cmp == 0 && (np < bestPool || (np == bestPool && (na < bestAll || (na == bestAll && a.Target < best.Target))))) {
			best, bestPool, bestAll, bestDef, found = a, np, na, def, true
		}
	}
	return best, found
}

// Offers reports whether live target a can take a new proxy of pool now.
func (pl *Placement) Offers(pool *Pool, a Target) bool {
	if !Eligible(pool, a) {
		return false
	}
	if pool.Spec.Image != "" && !slices.Contains(a.Images, pool.Spec.Image) {
		return false
	}
	if pool.Spec.Profile != "" && !slices.Contains(a.Profiles, pool.Spec.Profile) {
		return false
	}
	if !Labelled(pool, a) {
		return false
	}
	k := a.Key()
	if a.Capacity > 0 && pl.Load.All[k] >= a.Capacity {
		return false
	}
	if av, ok := pl.Avoid[k]; ok && pl.Now.Sub(av.At) < pl.QuotaAvoid {
		return false
	}
	return !pl.Failing(a)
}

// Eligible reports whether target a belongs to one of the pool's entries
// (its provider and its placement's entries: [events.PoolSpec.PlacementEntries])
// and, when the pool names targets, is one of them (by name, in any of
// its entries).
func Eligible(pool *Pool, a Target) bool {
	return slices.Contains(pool.Spec.PlacementEntries(), a.Entry) && (len(pool.Spec.Targets) == 0 || slices.Contains(pool.Spec.Targets, a.Target))
}

// entriesText names the pool's entries for a message: "entry local", or
// "entries hetzner, local" for a pool placed over several.
func entriesText(pool *Pool) string {
	es := pool.Spec.PlacementEntries()
	if len(es) == 1 {
		return "entry " + es[0]
	}
	return "entries " + strings.Join(es, ", ")
}

// targetName names target a in a message: its name, or "<entry>/<name>"
// in a pool placed over several entries.
func targetName(pool *Pool, a Target) string {
	if len(pool.Spec.PlacementEntries()) == 1 {
		return a.Target
	}
	return a.Entry + "/" + a.Target
}

// count adds delta to target k's load, for this pool and overall.
func (pl *Placement) count(k string, delta int) {
	pl.Load.All[k] += delta
	pl.Load.Pool[k] += delta
}

// clone copies pl with load maps of its own, so a pass over one pool can
// count its decisions without changing its caller's view.
func (pl *Placement) clone() *Placement {
	c := *pl
	c.Load = Load{All: make(map[string]int, len(pl.Load.All)), Pool: make(map[string]int, len(pl.Load.Pool))}
	for k, n := range pl.Load.All {
		c.Load.All[k] = n
	}
	for k, n := range pl.Load.Pool {
		c.Load.Pool[k] = n
	}
	return &c
}

// maxListed bounds the names a condition message lists.
const maxListed = 5

// Why explains why [Place] found no target for a proxy of pool, naming the
// targets it considered.
func Why(pl *Placement, pool *Pool) Miss {
	entry := entriesText(pool)
	var live []Target
	for _, a := range pl.Targets {
		if Eligible(pool, a) {
			live = append(live, a)
		}
	}
	if len(live) == 0 {
		considered := pool.Spec.Targets
		if len(considered) == 0 {
			considered = pl.Known
		}
		msg := "no live agent of " + entry
		if len(pl.Known) > 0 && len(considered) > 0 {
			msg += "; targets considered, none alive: " + JoinNames(considered)
		} else {
			// A pool applied before its entry's first agent.
			msg += "; no agent of this entry ever announced itself"
			if len(pool.Spec.PlacementEntries()) > 1 {
				msg = "no live agent of " + entry + "; no agent of these entries ever announced itself"
			}
		}
		return Miss{Reason: events.ReasonNoLiveTarget, Message: msg}
	}
	if img := pool.Spec.Image; img != "" {
		of := func(a Target) []string { return a.Images }
		l := offering(live, img, of)
		if len(l) == 0 {
			return Miss{Reason: events.ReasonNoTargetOffersImage,
				Message: fmt.Sprintf("no live target of %s offers image %s; considered: %s", entry, img, describe(pool, live, of))}
		}
		live = l
	}
	if prof := pool.Spec.Profile; prof != "" {
		of := func(a Target) []string { return a.Profiles }
		l := offering(live, prof, of)
		if len(l) == 0 {
			return Miss{Reason: events.ReasonNoTargetOffersProfile,
				Message: fmt.Sprintf("no live target of %s offers profile %s (with the pool's image); considered: %s", entry, prof, describe(pool, live, of))}
		}
		live = l
	}
	live, m, missed := labelMiss(pool, live)
	if missed {
		return m
	}
	note := pl.spreadNote(pool)
	var roomy []Target
	var full []string
	for _, a := range live {
		k := a.Key()
		if a.Capacity > 0 && pl.Load.All[k] >= a.Capacity {
			full = append(full, fmt.Sprintf("%s (%d of %d)", targetName(pool, a), pl.Load.All[k], a.Capacity))
			continue
		}
		roomy = append(roomy, a)
	}
	if len(roomy) == 0 {
		return Miss{Reason: events.ReasonCapacityExhausted,
			Message: "every live target that offers the pool's image and profile is full: " + JoinNames(full) + note}
	}
	var checked []Target
	var unhealthy []string
	for _, a := range roomy {
		if pl.Failing(a) {
			unhealthy = append(unhealthy, fmt.Sprintf("%s (%s)", targetName(pool, a), JoinNames(a.Check.Failing)))
			continue
		}
		checked = append(checked, a)
	}
	if len(checked) == 0 {
		return Miss{Reason: events.ReasonTargetsUnhealthy,
			Message: "every live target with room for the pool fails its checks: " + JoinNames(unhealthy) + note}
	}
	reason := events.ReasonTargetsFailing
	var avoided []string
	for _, a := range checked {
		av := pl.Avoid[a.Key()]
		if av.Class == events.ClassQuota {
			reason = events.ReasonQuota
		}
		avoided = append(avoided, fmt.Sprintf("%s (%s at %s, avoided until %s)", targetName(pool, a), av.Class,
			av.At.UTC().Format(time.RFC3339), av.At.Add(pl.QuotaAvoid).UTC().Format(time.RFC3339)))
	}
	sort.Strings(avoided)
	msg := "every remaining target failed recently: " + JoinNames(avoided)
	if len(unhealthy) > 0 {
		msg += "; the others fail their checks: " + JoinNames(unhealthy)
	}
	return Miss{Reason: reason, Message: msg + note}
}

// offering returns the targets whose list (of) holds want.
func offering(targets []Target, want string, of func(Target) []string) []Target {
	var out []Target
	for _, a := range targets {
		if slices.Contains(of(a), want) {
			out = append(out, a)
		}
	}
	return out
}

// describe names each target with what of says it offers.
func describe(pool *Pool, targets []Target, of func(Target) []string) string {
	parts := make([]string, 0, len(targets))
	for _, a := range targets {
		have := "nothing"
		if l := of(a); len(l) > 0 {
			have = strings.Join(l, ", ")
		}
		parts = append(parts, targetName(pool, a)+" (offers "+have+")")
	}
	return JoinNames(parts)
}

// JoinNames joins names, at most five of them.
func JoinNames(names []string) string {
	if len(names) <= maxListed {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:maxListed], ", ") + fmt.Sprintf(" and %d more", len(names)-maxListed)
}
