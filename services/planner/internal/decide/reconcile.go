package decide

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"proxyfleet/pkg/events"
)

// Kind is what a [Decision] does.
type Kind int

const (
	// Create requests a new proxy of the pool on Target; Proxy, when set,
	// is the member it replaces and Reason why.
	Create Kind = iota + 1
	// Retire retires Proxy for Reason and sends its delete; Class, when
	// set, is the replacement class it counts as (the fill replaces it).
	Retire
	// Abandon records that retiring Proxy, whose cleanup is skipped, is
	// abandoned: its instance is left alone.
	Abandon
	// Redelete issues the delete of retiring Proxy again, with the next
	// attempt.
	Redelete
	// Recreate issues the create of requested Proxy again, with the next
	// attempt. The writer skips it while the pool's secrets cannot be
	// sealed to the proxy's agent.
	Recreate
	// Fail records that Proxy failed with Class for Reason; the next
	// round retires and replaces it.
	Fail
)

func (k Kind) String() string {
	switch k {
	case Create:
		return "create"
	case Retire:
		return "retire"
	case Abandon:
		return "abandon"
	case Redelete:
		return "redelete"
	case Recreate:
		return "recreate"
	case Fail:
		return "fail"
	case List:
		return "list"
	case Run:
		return "run"
	case Unlist:
		return "unlist"
	case Forget:
		return "forget"
	case Disable:
		return "disable"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Decision is one thing a pool needs.
type Decision struct {
	Kind Kind
	// Proxy is the member decided about; for Create the member it
	// replaces, if any.
	Proxy Proxy
	// Target is where a Create places its proxy.
	Target Target
	// Reason is the retiring, abandoning, failure or replacement reason.
	Reason string
	// Class is a Fail's failure class, or a Retire's replacement class.
	Class string
	// CausedBy is the id of the proxy whose request caused this decision
	// (the replacement a condemned proxy retires for; the proxy itself for
	// a timeout), "" when none: its trace links to that request.
	CausedBy string
	// Note, when set, is worth a log line of its own when the decision is
	// stored.
	Note string
	// Listed is the listed proxy a List or Run records (external pools).
	Listed Listed
	// Until is when a Disable ends.
	Until time.Time
}

// Input is one pool's view for one round.
type Input struct {
	// Now is the wall clock; AgeNow the clock proxy ages and unhealthy
	// stretches are measured with (the same but in tests).
	Now, AgeNow time.Time
	Config      Config
	Pool        Pool
	// Members are the pool's live (non-terminal) proxies, in id order.
	Members []Proxy
	// Replacements holds the proxies the members' ReplacedBy names, by id
	// (a replacement may be in another pool).
	Replacements map[string]Proxy
	// Placement is the live targets and their load before this pool's
	// decisions; Reconcile does not change it.
	Placement *Placement
	// Health is whether the health service is alive: while it is not,
	// no running member times out for want of a probe.
	Health Health
}

// Found is what a pass over a pool found, for its conditions and timer.
type Found struct {
	// Active counts the live members that are not failed or retiring,
	// Ready those of them that are ready.
	Active, Ready int
	// Counted are the active members that count toward size; Condemned
	// are being replaced.
	Counted, Condemned []Proxy
	// Miss is why a proxy the pool needs could not be placed, nil when
	// none was missed; Missing is how many could not be placed.
	Miss    *Miss
	Missing int
	// HealthDownSince is [Health.Since] while health is down, zero
	// otherwise: the pool's readiness is unknown.
	HealthDownSince time.Time
	// StuckDeletes are the retiring members whose delete keeps failing
	// ([IsDeleteStuck]).
	StuckDeletes []Proxy
	// SpreadShort, when Miss is nil, names the spread values holding
	// fewer than their share that no live target can take a proxy of
	// (see [Placement.spreadShort]); "" when none.
	SpreadShort string
}

// Plan is what [Reconcile] decided for one pool.
type Plan struct {
	// Want is how many proxies the pool wants.
	Want      int
	Decisions []Decision
	Found     Found
}

// pass is one Reconcile in progress.
type pass struct {
	in    *Input
	pl    *Placement // the pool's placement, counting its own decisions
	want  int
	plan  Plan
	found *Found
}

// Notes of decisions that name the limit they hit.
const (
	// NotReadyPrefix starts the failure reason of a proxy that ran for
	// ReadyTimeout without one probe through it passing.
	NotReadyPrefix = "not ready after "
)

// Reconcile decides what one pool needs: see the package documentation
// for the rules and their order.
func Reconcile(in *Input) Plan {
	c := &pass{in: in, pl: in.Placement.clone()}
	if in.Pool.Spec.Placement != nil {
		c.pl.Record(in.Members)
	}
	c.found = &c.plan.Found
	if in.Health.Down {
		c.found.HealthDownSince = in.Health.Since
	}
	pool := &in.Pool
	cfg := in.Config
	// Sized once: a pool of 10,000 members grown by appends copied each
	// member many times over (a third of the planner's CPU in a fill).
	active := make([]Proxy, 0, len(in.Members))
	for _, x := range in.Members {
		age := in.Now.Sub(x.UpdatedAt)
		switch x.State {
		case events.ProxyFailed:
			class := ""
			if !pool.Deleted {
				// The fill replaces it.
				class = FailedClass(x)
			}
			c.retire(Decision{Kind: Retire, Proxy: x, Reason: "failed: " + x.FailureClass, Class: class})
		case events.ProxyRetiring:
			if x.SkipCleanup {
				c.add(Decision{Kind: Abandon, Proxy: x, Reason: x.Reason})
			} else if age >= cfg.RetireTimeout {
				c.add(Decision{Kind: Redelete, Proxy: x, Reason: x.Reason})
			}
			if IsDeleteStuck(cfg, x) {
				c.found.StuckDeletes = append(c.found.StuckDeletes, x)
			}
		case events.ProxyRequested:
			active = append(active, x)
			if age >= cfg.CreateTimeout {
				c.createTimedOut(x)
			}
		case events.ProxyProvisioning:
			active = append(active, x)
			if age >= cfg.ProvisionTimeout {
				c.timedOut(x, fmt.Sprintf("no address after %s of provisioning", cfg.ProvisionTimeout))
			}
		case events.ProxyRunning:
			active = append(active, x)
			if due, ok := ReadyDeadline(cfg, in.Health, x); ok && !in.Now.Before(due) {
				c.timedOut(x, fmt.Sprintf("%s%s running (no probe through it passed)", NotReadyPrefix, cfg.ReadyTimeout))
			}
		default:
			if IsActive(x.State) {
				active = append(active, x)
			}
		}
	}
	c.want = pool.Want()
	c.plan.Want = c.want
	reason := "scaled down"
	if pool.Deleted {
		reason = "pool deleted"
	}
	c.found.Active = len(active)
	for _, x := range active {
		if x.State == events.ProxyReady {
			c.found.Ready++
		}
	}
	if c.want == 0 {
		for _, x := range active {
			c.retire(Decision{Kind: Retire, Proxy: x, Reason: reason})
		}
		return c.plan
	}
	now := in.AgeNow
	after := pool.Spec.UnhealthyAfterOrDefault()
	c.found.Counted = make([]Proxy, 0, len(active))
	for _, x := range active {
		if _, replaced := Replacement(in.Replacements, x); replaced || IsSick(x, now, after) {
			c.found.Condemned = append(c.found.Condemned, x)
		} else {
			c.found.Counted = append(c.found.Counted, x)
		}
	}
	if pool.Spec.Placement != nil {
		for _, x := range c.found.Condemned {
			c.pl.Leave(x)
		}
	}
	retired := c.retireCondemned(now, after)
	if len(c.found.Counted) > c.want {
		for _, x := range RetireOrder(pool, c.found.Counted)[:len(c.found.Counted)-c.want] {
			c.retire(Decision{Kind: Retire, Proxy: x, Reason: reason})
		}
		return c.plan
	}
	// Sick proxies without a live replacement get one first: they do not
	// count toward size, so the fill below creates it, naming them.
	var sick []Proxy
	for _, x := range c.found.Condemned {
		if _, replaced := Replacement(in.Replacements, x); !replaced && !retired[x.ID] {
			sick = append(sick, x)
		}
	}
	sort.Slice(sick, func(i, j int) bool { return sick[i].UnhealthySince.Before(sick[j].UnhealthySince) })
	whys := make([]string, len(sick))
	for i, x := range sick {
		whys[i] = UnhealthyReason(x)
	}
	// Then a member sharing its egress address with an older one, in a
	// pool with distinctEgress: condemned, it stops counting, and the
	// fill replaces it (surge first, like a sick one).
	if x, why, ok := sharedEgress(pool, c.found.Counted, c.found.Condemned, in.Replacements); ok {
		c.found.Counted = slices.DeleteFunc(c.found.Counted, func(y Proxy) bool { return y.ID == x.ID })
		c.found.Condemned = append(c.found.Condemned, x)
		sick, whys = append(sick, x), append(whys, why)
	}
	for n := len(c.found.Counted); n < c.want; n++ {
		var replaces Proxy
		why := ""
		if len(sick) > 0 {
			replaces, why = sick[0], whys[0]
			sick, whys = sick[1:], whys[1:]
		}
		if !c.create(replaces, why, c.want-n) {
			return c.plan
		}
	}
	c.rotate()
	c.rebalance()
	c.noteSpread()
	return c.plan
}

// noteSpread records, when every proxy found a target, which spread
// values stay short of their share and why: the counted members, less
// those this round's creates replace, and the new proxies count.
func (c *pass) noteSpread() {
	pool := &c.in.Pool
	if c.found.Miss != nil || pool.Spec.Placement == nil || len(pool.Spec.Placement.Spread) == 0 {
		return
	}
	replaced := map[string]bool{}
	var created []Target
	for _, d := range c.plan.Decisions {
		if d.Kind == Create {
			created = append(created, d.Target)
			replaced[d.Proxy.ID] = d.Proxy.ID != ""
		}
	}
	kept := make([]Proxy, 0, len(c.found.Counted))
	for _, x := range c.found.Counted {
		if !replaced[x.ID] {
			kept = append(kept, x)
		}
	}
	c.found.SpreadShort = c.pl.spreadShort(pool, spreadCountsOf(pool, c.pl.liveLabels(), kept, created))
}

// add appends d to the plan.
func (c *pass) add(d Decision) { c.plan.Decisions = append(c.plan.Decisions, d) }

// retire appends a retirement; an active proxy is counted out at once, so
// later placements of this pass see it gone.
func (c *pass) retire(d Decision) {
	if IsActive(d.Proxy.State) {
		c.pl.count(TargetKey(d.Proxy.Entry, d.Proxy.Target), -1)
		c.pl.unleave(d.Proxy)
	}
	c.add(d)
}

// create places one new proxy of the pool, replacing replaces (for why)
// when it is set, and counts it on its target. It reports false, with the
// miss recorded, when no target can take it (missing proxies in all).
func (c *pass) create(replaces Proxy, why string, missing int) bool {
	pool := &c.in.Pool
	if pool.Spec.Placement != nil {
		c.pl.Leave(replaces)
	}
	a, ok := Place(c.pl, pool)
	if !ok {
		m := Why(c.pl, pool)
		c.found.Miss, c.found.Missing = &m, missing
		return false
	}
	c.pl.count(a.Key(), 1)
	c.add(Decision{Kind: Create, Proxy: replaces, Target: a, Reason: why})
	return true
}

// createTimedOut handles a proxy that stayed requested too long: when its
// target's agent is alive the create is issued again with the next
// attempt; when it is not, or the create was issued MaxCreateAttempts
// times already, the proxy fails and is replaced elsewhere.
func (c *pass) createTimedOut(x Proxy) {
	live := false
	for _, a := range c.in.Placement.Targets {
		if a.Entry == x.Entry && a.Target == x.Target {
			live = true
		}
	}
	d := Decision{Proxy: x, CausedBy: x.ID, Kind: Fail, Class: events.ClassTimeout}
	switch {
	case !live:
		d.Reason = fmt.Sprintf("no agent took the create within %s and target %s/%s is not alive", c.in.Config.CreateTimeout, x.Entry, x.Target)
	case x.Attempt >= c.in.Config.MaxCreateAttempts:
		// The agent is alive but never starts this create: fail it, so it
		// is replaced, and keep new proxies off the target for a while.
		d.Class = events.ClassStuck
		d.Reason = fmt.Sprintf("create issued %d times on %s/%s without reaching provisioning", x.Attempt, x.Entry, x.Target)
	default:
		d = Decision{Kind: Recreate, Proxy: x, CausedBy: x.ID}
	}
	c.add(d)
}

// timedOut records that x failed with class timeout for reason; the next
// round retires it and places its replacement.
func (c *pass) timedOut(x Proxy, reason string) {
	c.add(Decision{Kind: Fail, Proxy: x, Class: events.ClassTimeout, Reason: reason})
}

// FailedClass is the replacement class of failed proxy x: a proxy that
// timed out running without one probe through it passing never got ready;
// any other failure is "failed".
func FailedClass(x Proxy) string {
	if x.FailureClass == events.ClassTimeout && len(x.Reason) >= len(NotReadyPrefix) && x.Reason[:len(NotReadyPrefix)] == NotReadyPrefix {
		return "never-ready"
	}
	return "failed"
}

// retireRank orders excess proxies: unhealthy first, then those not yet
// running, then the rest.
func retireRank(s string) int {
	switch s {
	case events.ProxyUnhealthy:
		return 0
	case events.ProxyRequested, events.ProxyProvisioning:
		return 1
	}
	return 2
}

// RetireOrder returns counted in the order a scale-down retires them:
// unhealthy first, then those not yet running, outdated before current,
// oldest first, then by id.
func RetireOrder(pool *Pool, counted []Proxy) []Proxy {
	out := append([]Proxy(nil), counted...)
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if ra, rb := retireRank(a.State), retireRank(b.State); ra != rb {
			return ra < rb
		}
		if oa, ob := pool.IsOutdated(a), pool.IsOutdated(b); oa != ob {
			return oa
		}
		if !a.CreatedAt.Equal(b.CreatedAt) {
			return a.CreatedAt.Before(b.CreatedAt)
		}
		return a.ID < b.ID
	})
	return out
}
