package decide

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// The rules' table tests. Every case builds one pool's view at t0 and
// compares what the rules decide, written one decision per line:
// "<kind> <proxy> [on <target>] [<reason>] [class=<class>] [by=<id>]".

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

var testConfig = Config{
	CreateTimeout: 3 * time.Minute, ProvisionTimeout: 15 * time.Minute, ReadyTimeout: 15 * time.Minute,
	RetireTimeout: 3 * time.Minute, QuotaAvoid: 5 * time.Minute, MaxCreateAttempts: 5, StuckDeletes: 3,
}

// px is a proxy of pool p on local/<target> in state, created an hour
// before t0 and last updated half a minute before it, at revision 1,
// changed by opts.
func px(id, target, state string, opts ...func(*Proxy)) Proxy {
	x := Proxy{ProxyView: events.ProxyView{ID: id, Pool: "p", Entry: "local", Target: target, State: state,
		Attempt: 1, Revision: 1, CreatedAt: t0.Add(-time.Hour), UpdatedAt: t0.Add(-30 * time.Second)}}
	for _, o := range opts {
		o(&x)
	}
	return x
}

func updated(ago time.Duration) func(*Proxy) {
	return func(x *Proxy) { x.UpdatedAt = t0.Add(-ago) }
}
func created(ago time.Duration) func(*Proxy) {
	return func(x *Proxy) { x.CreatedAt = t0.Add(-ago) }
}
func unhealthyFor(ago time.Duration, reason string) func(*Proxy) {
	return func(x *Proxy) { x.UnhealthySince, x.Reason = t0.Add(-ago), reason }
}
func revision(n int) func(*Proxy) { return func(x *Proxy) { x.Revision = n } }
func attempt(n int) func(*Proxy)  { return func(x *Proxy) { x.Attempt = n } }
func replacedBy(id, why string) func(*Proxy) {
	return func(x *Proxy) { x.ReplacedBy, x.ReplaceReason = id, why }
}
func failed(class, reason string) func(*Proxy) {
	return func(x *Proxy) { x.FailureClass, x.Reason = class, reason }
}
func reason(r string) func(*Proxy) { return func(x *Proxy) { x.Reason = r } }
func skipCleanup() func(*Proxy)    { return func(x *Proxy) { x.SkipCleanup = true } }
func tg(name string) Target        { return Target{Entry: "local", Target: name} }

// testCheckMaxAge is the placement's CheckMaxAge in the tests.
const testCheckMaxAge = 90 * time.Second

// checked gives t a check verdict taken ago before t0, failing with
// failing when it is not empty.
func checked(t Target, ago time.Duration, failing ...string) Target {
	t.Check = &Check{OK: len(failing) == 0, At: t0.Add(-ago), Failing: failing}
	return t
}
func capped(t Target, n int) Target { t.Capacity = n; return t }
func offers(t Target, images, profiles []string) Target {
	t.Images, t.Profiles = images, profiles
	return t
}

// pool is pool p of entry local wanting size proxies at revision 1.
func pool(size int, opts ...func(*Pool)) Pool {
	p := Pool{Name: "p", Spec: events.PoolSpec{Name: "p", Provider: "local", Size: size}, Revision: 1, ShapeRevision: 1}
	for _, o := range opts {
		o(&p)
	}
	return p
}

// line writes a decision as the tables do.
func line(d Decision) string {
	var b strings.Builder
	b.WriteString(d.Kind.String())
	if d.Kind == Create {
		fmt.Fprintf(&b, " on %s", d.Target.Target)
		if d.Proxy.ID != "" {
			fmt.Fprintf(&b, " replacing %s", d.Proxy.ID)
		}
	} else {
		fmt.Fprintf(&b, " %s", d.Proxy.ID)
	}
	if d.Reason != "" {
		fmt.Fprintf(&b, " %q", d.Reason)
	}
	if d.Class != "" {
		fmt.Fprintf(&b, " class=%s", d.Class)
	}
	if d.CausedBy != "" {
		fmt.Fprintf(&b, " by=%s", d.CausedBy)
	}
	if d.Note != "" {
		b.WriteString(" +note")
	}
	return b.String()
}

type reconcileCase struct {
	name    string
	pool    Pool
	members []Proxy
	// replacements are proxies members' ReplacedBy names that are not
	// members (another pool's, or terminal); members are found too.
	replacements []Proxy
	targets      []Target
	// load and poolLoad are all pools' and this pool's load per target
	// name; nil: the active members'.
	load, poolLoad map[string]int
	avoid          map[string]Avoidance
	known          []string
	want           []string
	miss           string // the Placed reason of a miss, "" for none
	missText       string // a part of the miss's message
	health         Health
	stuck          []string // ids of the stuck deletes found
}

func (tc reconcileCase) run(t *testing.T) Plan {
	t.Helper()
	targets := tc.targets
	if targets == nil {
		targets = []Target{tg("t1"), tg("t2")}
	}
	keyed := func(m map[string]int) map[string]int {
		out := map[string]int{}
		for k, n := range m {
			out[TargetKey("local", k)] = n
		}
		return out
	}
	avoid := map[string]Avoidance{}
	for k, a := range tc.avoid {
		avoid[TargetKey("local", k)] = a
	}
	repl := map[string]Proxy{}
	for _, x := range append(slices.Clone(tc.members), tc.replacements...) {
		repl[x.ID] = x
	}
	if tc.load == nil && tc.poolLoad == nil {
		tc.load, tc.poolLoad = map[string]int{}, map[string]int{}
		for _, x := range tc.members {
			if IsActive(x.State) {
				tc.load[x.Target]++
				tc.poolLoad[x.Target]++
			}
		}
	}
	load, poolLoad := keyed(tc.load), keyed(tc.poolLoad)
	in := &Input{Now: t0, AgeNow: t0, Config: testConfig, Pool: tc.pool, Members: tc.members, Replacements: repl, Health: tc.health,
		Placement: &Placement{Now: t0, Targets: targets, Load: Load{All: load, Pool: poolLoad}, Avoid: avoid, Known: tc.known, QuotaAvoid: testConfig.QuotaAvoid,
			CheckMaxAge: testCheckMaxAge}}
	plan := Reconcile(in)
	var got []string
	for _, d := range plan.Decisions {
		got = append(got, line(d))
	}
	if !slices.Equal(got, tc.want) {
		t.Errorf("decisions:\n got  %s\n want %s", strings.Join(got, "\n      "), strings.Join(tc.want, "\n      "))
	}
	switch m := plan.Found.Miss; {
	case m == nil && tc.miss != "":
		t.Errorf("miss: got none, want %s", tc.miss)
	case m != nil && m.Reason != tc.miss:
		t.Errorf("miss: got %s (%s), want %q", m.Reason, m.Message, tc.miss)
	case m != nil && !strings.Contains(m.Message, tc.missText):
		t.Errorf("miss message: got %q, want it to contain %q", m.Message, tc.missText)
	}
	var stuck []string
	for _, x := range plan.Found.StuckDeletes {
		stuck = append(stuck, x.ID)
	}
	if !slices.Equal(stuck, tc.stuck) {
		t.Errorf("stuck deletes: got %v, want %v", stuck, tc.stuck)
	}
	if !maps2Equal(in.Placement.Load.All, keyed(tc.load)) {
		t.Errorf("Reconcile changed its input's load: %v", in.Placement.Load.All)
	}
	return plan
}

func maps2Equal(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestReconcile(t *testing.T) {
	old := created(2 * time.Hour)
	cases := []reconcileCase{
		// The fill and placement.
		{name: "empty pool fills, spread over targets", pool: pool(3),
			want: []string{"create on t1", "create on t2", "create on t1"}},
		{name: "fewest of this pool first, then fewest overall", pool: pool(2),
			targets: []Target{tg("t1"), tg("t2"), tg("t3")}, poolLoad: map[string]int{"t1": 1}, load: map[string]int{"t1": 1, "t2": 5},
			members: []Proxy{px("a", "t1", events.ProxyReady)},
			want:    []string{"create on t3"}},
		{name: "at size: nothing", pool: pool(2),
			members: []Proxy{px("a", "t1", events.ProxyReady), px("b", "t2", events.ProxyReady)}},
		{name: "pool targets restrict placement", pool: pool(1, func(p *Pool) { p.Spec.Targets = []string{"t2"} }),
			want: []string{"create on t2"}},
		{name: "a full target is skipped", pool: pool(1),
			targets: []Target{capped(tg("t1"), 2), tg("t2")}, load: map[string]int{"t1": 2, "t2": 9},
			want: []string{"create on t2"}},
		{name: "an avoided target is skipped while the avoidance lasts", pool: pool(1),
			avoid: map[string]Avoidance{"t1": {Class: events.ClassQuota, At: t0.Add(-time.Minute)}},
			want:  []string{"create on t2"}},
		{name: "an avoidance older than QuotaAvoid no longer counts", pool: pool(1),
			avoid: map[string]Avoidance{"t1": {Class: events.ClassQuota, At: t0.Add(-6 * time.Minute)}},
			want:  []string{"create on t1"}},
		{name: "image and profile must be offered", pool: pool(1, func(p *Pool) { p.Spec.Image, p.Spec.Profile = "img", "small" }),
			targets: []Target{offers(tg("t1"), []string{"img"}, nil), offers(tg("t2"), []string{"img"}, []string{"small"})},
			want:    []string{"create on t2"}},
		{name: "autoscaled pool wants its autoscaled size", pool: pool(1, func(p *Pool) {
			p.Spec.Autoscale = &events.Autoscale{Min: 1, Max: 3, TargetConnections: 1}
			p.Autoscaled = 2
		}), want: []string{"create on t1", "create on t2"}},
		{name: "autoscaled size is clamped into [min, max]", pool: pool(5, func(p *Pool) {
			p.Spec.Autoscale = &events.Autoscale{Min: 1, Max: 1, TargetConnections: 1}
		}), want: []string{"create on t1"}},

		// Placement misses: the Placed condition's reasons.
		{name: "no live target", pool: pool(2), targets: []Target{}, known: []string{"t7", "t8"},
			want: nil, miss: events.ReasonNoLiveTarget, missText: "targets considered, none alive: t7, t8"},
		{name: "no agent ever announced", pool: pool(1), targets: []Target{},
			miss: events.ReasonNoLiveTarget, missText: "no agent of this entry ever announced itself"},
		{name: "no live target of the pool's targets", pool: pool(1, func(p *Pool) { p.Spec.Targets = []string{"t9"} }), known: []string{"t1"},
			miss: events.ReasonNoLiveTarget, missText: "none alive: t9"},
		{name: "the pool's targets, of an entry no agent ever announced", pool: pool(1, func(p *Pool) { p.Spec.Targets = []string{"h1"} }),
			miss: events.ReasonNoLiveTarget, missText: "no agent of this entry ever announced itself"},
		{name: "no target offers the image", pool: pool(1, func(p *Pool) { p.Spec.Image = "img" }),
			targets: []Target{offers(tg("t1"), []string{"other"}, nil)},
			miss:    events.ReasonNoTargetOffersImage, missText: "t1 (offers other)"},
		{name: "no target offers the profile", pool: pool(1, func(p *Pool) { p.Spec.Profile = "big" }),
			targets: []Target{tg("t1")},
			miss:    events.ReasonNoTargetOffersProfile, missText: "t1 (offers nothing)"},
		{name: "every target full", pool: pool(1), targets: []Target{capped(tg("t1"), 1)}, load: map[string]int{"t1": 1},
			miss: events.ReasonCapacityExhausted, missText: "t1 (1 of 1)"},
		{name: "the fill places what fits and misses the rest", pool: pool(3), targets: []Target{capped(tg("t1"), 2)},
			want: []string{"create on t1", "create on t1"}, miss: events.ReasonCapacityExhausted, missText: "t1 (2 of 2)"},
		{name: "every target answered quota", pool: pool(1),
			avoid: map[string]Avoidance{"t1": {Class: events.ClassQuota, At: t0}, "t2": {Class: events.ClassStuck, At: t0}},
			miss:  events.ReasonQuota, missText: "every remaining target failed recently"},
		{name: "every target had a stuck create", pool: pool(1),
			avoid: map[string]Avoidance{"t1": {Class: events.ClassStuck, At: t0}, "t2": {Class: events.ClassStuck, At: t0}},
			miss:  events.ReasonTargetsFailing, missText: "t1 (stuck at"},

		// distinctEgress.
		{name: "distinctEgress: the newer of two members sharing an egress is replaced", pool: distinct(2),
			members: []Proxy{px("a", "t1", events.ProxyReady, created(2*time.Hour), egressIP("192.0.2.1")), px("b", "t2", events.ProxyReady, egressIP("192.0.2.1"))},
			want:    []string{`create on t1 replacing b "shared-egress: egress 192.0.2.1 is a's too"`}},
		{name: "distinctEgress: distinct egresses, nothing", pool: distinct(2),
			members: []Proxy{px("a", "t1", events.ProxyReady, egressIP("192.0.2.1")), px("b", "t2", events.ProxyReady, egressIP("192.0.2.2"))}},
		{name: "without distinctEgress a shared egress is fine", pool: pool(2),
			members: []Proxy{px("a", "t1", events.ProxyReady, egressIP("192.0.2.1")), px("b", "t2", events.ProxyReady, egressIP("192.0.2.1"))}},
		{name: "distinctEgress: one replacement at a time", pool: distinct(3),
			members: []Proxy{px("a", "t1", events.ProxyReady, created(3*time.Hour), egressIP("192.0.2.1")),
				px("b", "t2", events.ProxyReady, created(2*time.Hour), egressIP("192.0.2.1"), replacedBy("d", "shared-egress: egress 192.0.2.1 is a's too")),
				px("c", "t1", events.ProxyReady, egressIP("192.0.2.1")), px("d", "t2", events.ProxyRequested)}},
		{name: "distinctEgress: the shared one is retired once its replacement is ready", pool: distinct(2),
			members: []Proxy{px("a", "t1", events.ProxyReady, created(3*time.Hour), egressIP("192.0.2.1")),
				px("b", "t2", events.ProxyReady, egressIP("192.0.2.1"), replacedBy("c", "shared-egress: egress 192.0.2.1 is a's too")),
				px("c", "t2", events.ProxyReady, egressIP("192.0.2.3"))},
			want: []string{`retire b "shared-egress: egress 192.0.2.1 is a's too" by=c`}},

		// Stuck deletes (TestCleanupCondition has the condition).
		{name: "a delete re-issued StuckDeletes times is stuck, and re-issued again", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, updated(3*time.Minute), func(x *Proxy) { x.DeleteAttempt = 4 })},
			want:    []string{`redelete a`}, stuck: []string{"a"}},
		{name: "a delete re-issued fewer times is not stuck", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, updated(time.Minute), func(x *Proxy) { x.DeleteAttempt = 3 })}},
		{name: "an abandoned-to-be retirement is never stuck", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, skipCleanup(), func(x *Proxy) { x.DeleteAttempt = 9 })},
			want:    []string{`abandon a`}},

		// Target checks (health's fleet-targets).
		{name: "a target whose check fails takes no proxy", pool: pool(2),
			targets: []Target{checked(tg("t1"), 10*time.Second, "pool: not running"), checked(tg("t2"), 10*time.Second)},
			want:    []string{"create on t2", "create on t2"}},
		{name: "a failed check older than CheckMaxAge does not block", pool: pool(1),
			targets: []Target{checked(tg("t1"), testCheckMaxAge, "pool: not running")},
			want:    []string{"create on t1"}},
		{name: "every target failing its checks: TargetsUnhealthy naming them and their checks", pool: pool(1),
			targets: []Target{checked(tg("t1"), time.Second, "pool: not running", "disk: 1% free"), checked(tg("t2"), time.Second, "check request: timeout")},
			miss:    events.ReasonTargetsUnhealthy, missText: "fails its checks: t1 (pool: not running, disk: 1% free), t2 (check request: timeout)"},
		{name: "failing checks and avoidance: the avoided say why, the failing are named", pool: pool(1),
			targets: []Target{checked(tg("t1"), time.Second, "pool: not running"), tg("t2")},
			avoid:   map[string]Avoidance{"t2": {Class: events.ClassQuota, At: t0}},
			miss:    events.ReasonQuota, missText: "; the others fail their checks: t1 (pool: not running)"},

		// Failed and retiring members.
		{name: "a failed member is retired and replaced by the fill", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyFailed, failed(events.ClassTerminated, "exited"))},
			want:    []string{`retire a "failed: terminated" class=failed`, "create on t1"}},
		{name: "a member failed never ready counts as never-ready", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyFailed, failed(events.ClassTimeout, "not ready after 15m0s running"))},
			want:    []string{`retire a "failed: timeout" class=never-ready`, "create on t1"}},
		{name: "a failed member of a deleted pool is not counted as replaced", pool: pool(1, func(p *Pool) { p.Deleted = true }),
			members: []Proxy{px("a", "t1", events.ProxyFailed, failed(events.ClassTerminated, "exited"))},
			want:    []string{`retire a "failed: terminated"`}},
		{name: "retiring with skipCleanup is abandoned", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, skipCleanup(), reason("deleted by operator, cleanup skipped"))},
			want:    []string{`abandon a "deleted by operator, cleanup skipped"`}},
		{name: "retiring past RetireTimeout has its delete re-issued", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, updated(3*time.Minute), reason("scaled down"))},
			want:    []string{`redelete a "scaled down"`}},
		{name: "retiring within RetireTimeout waits", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyRetiring, updated(time.Minute))}},

		// Timeouts.
		{name: "requested past CreateTimeout with its agent alive: create again", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyRequested, updated(3*time.Minute))},
			want:    []string{"recreate a by=a"}},
		{name: "requested within CreateTimeout waits", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyRequested, updated(time.Minute))}},
		{name: "requested past CreateTimeout on a dead target fails", pool: pool(1),
			members: []Proxy{px("a", "t9", events.ProxyRequested, updated(3*time.Minute))},
			want:    []string{`fail a "no agent took the create within 3m0s and target local/t9 is not alive" class=timeout by=a`}},
		{name: "a create issued MaxCreateAttempts times fails stuck", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyRequested, updated(3*time.Minute), attempt(5))},
			want:    []string{`fail a "create issued 5 times on local/t1 without reaching provisioning" class=stuck by=a`}},
		{name: "provisioning past ProvisionTimeout fails", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyProvisioning, updated(15*time.Minute))},
			want:    []string{`fail a "no address after 15m0s of provisioning" class=timeout`}},
		{name: "running past ReadyTimeout fails never ready", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(15*time.Minute))},
			want:    []string{`fail a "not ready after 15m0s running (no probe through it passed)" class=timeout`}},
		{name: "running within ReadyTimeout waits", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(14*time.Minute))}},
		{name: "running past ReadyTimeout while health is down waits", pool: pool(1),
			health:  Health{Down: true, Since: t0.Add(-20 * time.Minute)},
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(time.Hour))}},
		{name: "running past ReadyTimeout, health back for less: a fresh deadline", pool: pool(1),
			health:  Health{Back: t0.Add(-14 * time.Minute)},
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(time.Hour))}},
		{name: "running past ReadyTimeout since health came back fails", pool: pool(1),
			health:  Health{Back: t0.Add(-15 * time.Minute)},
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(time.Hour))},
			want:    []string{`fail a "not ready after 15m0s running (no probe through it passed)" class=timeout`}},
		{name: "health down: provisioning still times out (an agent's matter)", pool: pool(1),
			health:  Health{Down: true, Since: t0.Add(-20 * time.Minute)},
			members: []Proxy{px("a", "t1", events.ProxyProvisioning, updated(15*time.Minute))},
			want:    []string{`fail a "no address after 15m0s of provisioning" class=timeout`}},

		// Scale-down and deletion.
		{name: "deleted pool retires every active member", pool: pool(2, func(p *Pool) { p.Deleted = true }),
			members: []Proxy{px("a", "t1", events.ProxyReady), px("b", "t2", events.ProxyRequested)},
			want:    []string{`retire a "pool deleted"`, `retire b "pool deleted"`}},
		{name: "size 0 retires every active member", pool: pool(0),
			members: []Proxy{px("a", "t1", events.ProxyReady)},
			want:    []string{`retire a "scaled down"`}},
		{name: "scale-down retires unhealthy first", pool: pool(2),
			members: []Proxy{px("a", "t1", events.ProxyReady, old), px("b", "t2", events.ProxyUnhealthy, unhealthyFor(time.Second, "x")), px("c", "t1", events.ProxyReady)},
			want:    []string{`retire b "scaled down"`}},
		{name: "scale-down retires not yet running before running", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyReady, old), px("b", "t2", events.ProxyProvisioning)},
			want:    []string{`retire b "scaled down"`}},
		{name: "scale-down retires outdated before current", pool: pool(1, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }),
			members: []Proxy{px("a", "t1", events.ProxyReady, revision(2), old), px("b", "t2", events.ProxyReady)},
			want:    []string{`retire b "scaled down"`}},
		{name: "scale-down retires oldest first", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyReady), px("b", "t2", events.ProxyReady, old)},
			want:    []string{`retire b "scaled down"`}},

		// Heal (docs/operator-guide.md, "Healing").
		{name: "unhealthy within unhealthyAfter: kept, nothing yet", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(time.Minute, "probe failed"))}},
		{name: "unhealthy past unhealthyAfter: a replacement naming it", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(2*time.Minute, "probe failed"))},
			want:    []string{`create on t2 replacing a "unhealthy: probe failed"`}},
		{name: "sick proxies replaced longest unhealthy first", pool: pool(2),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(2*time.Minute, "x")), px("b", "t2", events.ProxyUnhealthy, unhealthyFor(3*time.Minute, "y"))},
			want:    []string{`create on t1 replacing b "unhealthy: y"`, `create on t2 replacing a "unhealthy: x"`}},
		{name: "the replacement ready: the sick proxy retires", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(3*time.Minute, "probe failed"), replacedBy("b", "unhealthy: probe failed")),
				px("b", "t2", events.ProxyReady)},
			want: []string{`retire a "unhealthy: probe failed" by=b`}},
		{name: "the replacement not ready yet: the sick proxy waits", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(3*time.Minute, "probe failed"), replacedBy("b", "unhealthy: probe failed")),
				px("b", "t2", events.ProxyProvisioning)}},
		{name: "no replacement ready after twice unhealthyAfter: retired all the same", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(4*time.Minute, "probe failed"), replacedBy("b", "unhealthy: probe failed")),
				px("b", "t2", events.ProxyProvisioning)},
			want: []string{`retire a "unhealthy: probe failed" by=b +note`}},
		{name: "a recovered proxy with a live replacement stays condemned", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyReady, replacedBy("b", "recycled by operator")), px("b", "t2", events.ProxyRunning)}},
		{name: "a recycled proxy retires once its replacement is ready", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyReady, replacedBy("b", "recycled by operator")), px("b", "t2", events.ProxyReady)},
			want:    []string{`retire a "recycled by operator" by=b`}},
		{name: "a condemned proxy retires once the counted alone are ready", pool: pool(1),
			members:      []Proxy{px("a", "t1", events.ProxyReady, replacedBy("c", "recycled by operator")), px("b", "t2", events.ProxyReady)},
			replacements: []Proxy{px("c", "t1", events.ProxyRequested)},
			want:         []string{`retire a "recycled by operator" by=c`}},
		{name: "a replacement that failed leaves the proxy counted", pool: pool(1),
			members:      []Proxy{px("a", "t1", events.ProxyReady, replacedBy("c", "recycled by operator"))},
			replacements: []Proxy{px("c", "t1", events.ProxyDeleted)}},
		{name: "an unhealthy proxy replaced for another reason retires as unhealthy", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(time.Second, "dns"), replacedBy("b", "recycled by operator")), px("b", "t2", events.ProxyReady)},
			want:    []string{`retire a "recycled by operator" by=b`}},
		{name: "a replaced proxy without a reason retires as replaced", pool: pool(1),
			members: []Proxy{px("a", "t1", events.ProxyReady, replacedBy("b", "")), px("b", "t2", events.ProxyReady)},
			want:    []string{`retire a "replaced" by=b`}},

		// Rotation and rolls.
		{name: "an outdated member is rolled surge first", pool: pool(2, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }),
			members: []Proxy{px("a", "t1", events.ProxyReady), px("b", "t2", events.ProxyReady, revision(2))},
			want:    []string{`create on t1 replacing a "rolled: spec revision 2" +note`}},
		{name: "one roll at a time", pool: pool(2, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }),
			members: []Proxy{px("a", "t1", events.ProxyReady, replacedBy("c", "rolled: spec revision 2")), px("b", "t2", events.ProxyReady), px("c", "t1", events.ProxyRequested, revision(2))}},
		{name: "rotation waits until the pool is at size", pool: pool(3, func(p *Pool) { p.Spec.MaxAge = events.Duration(time.Minute) }),
			targets: []Target{tg("t1")}, load: map[string]int{"t1": 2}, poolLoad: map[string]int{"t1": 2},
			members: []Proxy{px("a", "t1", events.ProxyReady), px("b", "t1", events.ProxyReady)},
			want:    []string{"create on t1"}},
		{name: "an aged member is rotated", pool: pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(time.Minute) }),
			members: []Proxy{px("a", "t1", events.ProxyReady)},
			want:    []string{`create on t2 replacing a "rotated: older than maxAge 1m0s" +note`}},
		{name: "a member younger than maxAge is not rotated", pool: pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(2 * time.Hour) }),
			members: []Proxy{px("a", "t1", events.ProxyReady)}},
		{name: "outdated before aged, unhealthy before healthy", pool: pool(3, func(p *Pool) {
			p.Spec.MaxAge, p.Revision, p.ShapeRevision = events.Duration(time.Minute), 2, 2
		}),
			members: []Proxy{px("a", "t1", events.ProxyReady, revision(2)), px("b", "t2", events.ProxyReady), px("c", "t1", events.ProxyUnhealthy, unhealthyFor(time.Second, "x"))},
			want:    []string{`create on t2 replacing c "rolled: spec revision 2" +note`}},
		{name: "a sick member's replacement does not take the surge slot", pool: pool(2, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }),
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(3*time.Minute, "x"), replacedBy("c", "unhealthy: x")),
				px("b", "t2", events.ProxyReady), px("c", "t1", events.ProxyRequested, revision(2))},
			want: []string{`create on t2 replacing b "rolled: spec revision 2" +note`}},
		{name: "no target for the rotation: a miss", pool: pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(time.Minute) }),
			targets: []Target{capped(tg("t1"), 1)}, load: map[string]int{"t1": 1},
			members: []Proxy{px("a", "t1", events.ProxyReady)}, miss: events.ReasonCapacityExhausted},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { tc.run(t) })
	}
}

func egressIP(ip string) func(*Proxy) { return func(x *Proxy) { x.EgressIP = ip } }

// distinct is pool(size) with distinctEgress.
func distinct(size int) Pool {
	return pool(size, func(p *Pool) { p.Spec.DistinctEgress = true })
}
