package decide

import (
	"fmt"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// Every row of docs/operator-guide.md's "Pool conditions" table that the
// rules set (the Placed misses' messages are Why's, tested in
// TestReconcile).
func TestConditions(t *testing.T) {
	outdated := pool(2, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 })
	aging := pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(time.Minute) })
	ready := func(id string, opts ...func(*Proxy)) Proxy { return px(id, "t1", events.ProxyReady, opts...) }
	cases := []struct {
		name  string
		pool  Pool
		want  int
		found Found
		// ready, placed and progressing as "<status> <reason>: <message>"
		ready, placed, progressing string
	}{
		{name: "settled", pool: pool(2), want: 2,
			found: Found{Active: 2, Ready: 2, Counted: []Proxy{ready("a"), ready("b")}},
			ready: "True EnoughReady: 2 of 2 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "False Settled: the pool matches its spec"},
		{name: "growing", pool: pool(2), want: 2,
			found: Found{Active: 1, Ready: 1, Counted: []Proxy{ready("a")}},
			ready: "False NotEnoughReady: fewer than 2 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Scaling: scaling to 2 proxies"},
		{name: "new proxies not ready yet", pool: pool(1), want: 1,
			found: Found{Active: 1, Counted: []Proxy{px("a", "t1", events.ProxyProvisioning)}},
			ready: "False NotEnoughReady: fewer than 1 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Scaling: scaling to 1 proxies"},
		{name: "shrinking to zero", pool: pool(0), want: 0,
			found: Found{Active: 1, Ready: 1},
			ready: "True EnoughReady: 0 of 0 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Scaling: scaling to 0 proxies"},
		{name: "a miss", pool: pool(1), want: 1,
			found: Found{Miss: &Miss{Reason: events.ReasonNoLiveTarget, Message: "no live agent of entry local"}},
			ready: "False NotEnoughReady: fewer than 1 proxies ready", placed: "False NoLiveTarget: no live agent of entry local",
			progressing: "True Scaling: scaling to 1 proxies"},
		{name: "the writer's secrets miss", pool: pool(1), want: 1,
			found: Found{Miss: &Miss{Reason: events.ReasonSecretsUnavailable, Message: "re-apply the pool"}},
			ready: "False NotEnoughReady: fewer than 1 proxies ready", placed: "False SecretsUnavailable: re-apply the pool",
			progressing: "True Scaling: scaling to 1 proxies"},
		{name: "rolling", pool: outdated, want: 2,
			found: Found{Active: 2, Ready: 2, Counted: []Proxy{ready("a"), ready("b", revision(2))}},
			ready: "True EnoughReady: 2 of 2 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Rolling: rolling to spec revision 2"},
		{name: "rolling while the last outdated is condemned", pool: outdated, want: 2,
			found: Found{Active: 3, Ready: 2, Counted: []Proxy{ready("b", revision(2)), ready("c", revision(2))}, Condemned: []Proxy{ready("a")}},
			ready: "True EnoughReady: 2 of 2 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Rolling: rolling to spec revision 2"},
		{name: "replacing names the condemned", pool: pool(1), want: 1,
			found: Found{Active: 2, Ready: 1, Counted: []Proxy{px("b", "t1", events.ProxyRequested)}, Condemned: []Proxy{ready("a")}},
			ready: "True EnoughReady: 1 of 1 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Replacing: replacing a"},
		{name: "replacing lists five and counts the rest", pool: pool(7), want: 7,
			found: Found{Condemned: []Proxy{ready("a"), ready("b"), ready("c"), ready("d"), ready("e"), ready("f"), ready("g")}},
			ready: "False NotEnoughReady: fewer than 7 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Replacing: replacing a, b, c, d, e and 2 more"},
		{name: "health down: readiness unknown", pool: pool(1), want: 1,
			found:  Found{Active: 1, Ready: 1, Counted: []Proxy{ready("a")}, HealthDownSince: t0.Add(-time.Minute)},
			ready:  "Unknown HealthUnavailable: no health replica is alive since 2026-03-01T11:59:00Z; readiness unknown (no proxy is failed for want of a probe until health is back)",
			placed: "True Placed: every proxy the pool needs has a target", progressing: "False Settled: the pool matches its spec"},
		{name: "rotating", pool: aging, want: 1,
			found: Found{Active: 1, Ready: 1, Counted: []Proxy{ready("a")}},
			ready: "True EnoughReady: 1 of 1 proxies ready", placed: "True Placed: every proxy the pool needs has a target",
			progressing: "True Rotating: rotating proxies older than maxAge 1m0s"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := Conditions(&tc.pool, tc.want, &tc.found, t0)
			if len(cs) != 3 {
				t.Fatalf("got %d conditions, want 3", len(cs))
			}
			for i, want := range []struct{ typ, line string }{
				{events.ConditionReady, tc.ready}, {events.ConditionPlaced, tc.placed}, {events.ConditionProgressing, tc.progressing},
			} {
				c := cs[i]
				if got := fmt.Sprintf("%s %s: %s", c.Status, c.Reason, c.Message); c.Type != want.typ || got != want.line {
					t.Errorf("%s: got %s %q, want %q", want.typ, c.Type, got, want.line)
				}
			}
		})
	}
}

func TestChangedConditions(t *testing.T) {
	p := pool(1)
	cs := Conditions(&p, 1, &Found{Active: 1, Ready: 1, Counted: []Proxy{px("a", "t1", events.ProxyReady)}}, t0)
	if got := Changed(&p, cs); len(got) != 3 {
		t.Errorf("a pool without conditions: got %d changed, want all 3", len(got))
	}
	for _, c := range cs {
		p.Conditions = append(p.Conditions, events.Condition{Type: c.Type, Status: c.Status, Reason: c.Reason, Message: c.Message})
	}
	if got := Changed(&p, cs); len(got) != 0 {
		t.Errorf("the same conditions again: got %v changed, want none", got)
	}
	p.Conditions[2].Message = "older message"
	if got := Changed(&p, cs); len(got) != 1 || got[0].Type != events.ConditionProgressing {
		t.Errorf("one message changed: got %v, want Progressing alone", got)
	}
}

func TestTimer(t *testing.T) {
	after := events.DefaultUnhealthyAfter
	cases := []struct {
		name        string
		pool        Pool
		members     []Proxy
		retry       bool
		health      Health
		due, ageDue time.Time
	}{
		{name: "nothing pending", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyReady)}},
		{name: "retry", pool: pool(1), retry: true},
		{name: "create timeout", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyRequested, updated(time.Minute))},
			due: t0.Add(2 * time.Minute)},
		{name: "provision timeout", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyProvisioning, updated(time.Minute))},
			due: t0.Add(14 * time.Minute)},
		{name: "ready timeout", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyRunning, updated(5*time.Minute))},
			due: t0.Add(10 * time.Minute)},
		{name: "no ready timeout while health is down", pool: pool(1), health: Health{Down: true, Since: t0.Add(-time.Hour)},
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(5*time.Minute))}},
		{name: "ready timeout counts from health's return", pool: pool(1), health: Health{Back: t0.Add(-time.Minute)},
			members: []Proxy{px("a", "t1", events.ProxyRunning, updated(5*time.Minute))},
			due:     t0.Add(14 * time.Minute)},
		{name: "retire timeout, the earliest of several", pool: pool(1), members: []Proxy{
			px("a", "t1", events.ProxyRetiring, updated(time.Minute)), px("b", "t1", events.ProxyRetiring, updated(2*time.Minute))},
			due: t0.Add(time.Minute)},
		{name: "an abandoned-to-be retirement has no timeout", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyRetiring, skipCleanup())}},
		{name: "unhealthy turns sick", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(time.Minute, "x"))},
			ageDue: t0.Add(after - time.Minute)},
		{name: "sick: retired regardless at twice unhealthyAfter", pool: pool(1), members: []Proxy{px("a", "t1", events.ProxyUnhealthy, unhealthyFor(3*time.Minute, "x"))},
			ageDue: t0.Add(2*after - 3*time.Minute)},
		{name: "maxAge plus jitter", pool: pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(2 * time.Hour) }),
			members: []Proxy{px("a", "t1", events.ProxyReady)},
			ageDue:  t0.Add(-time.Hour + 2*time.Hour + RotationJitter("a", 2*time.Hour) + time.Nanosecond)},
		{name: "an age already past is not a timer", pool: pool(1, func(p *Pool) { p.Spec.MaxAge = events.Duration(time.Minute) }),
			members: []Proxy{px("a", "t1", events.ProxyReady)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Timer(testConfig, &tc.pool, tc.members, tc.health, tc.retry, t0)
			want := When{Retry: tc.retry, Due: tc.due, AgeDue: tc.ageDue}
			if got != want {
				t.Errorf("got %+v, want %+v", got, want)
			}
		})
	}
}

func TestWhenIsDue(t *testing.T) {
	cases := []struct {
		name string
		w    When
		want bool
	}{
		{"zero", When{}, false},
		{"retry", When{Retry: true}, true},
		{"due now", When{Due: t0}, true},
		{"due later", When{Due: t0.Add(time.Second)}, false},
		{"age due passed", When{AgeDue: t0.Add(-time.Second)}, true},
		{"age due later", When{AgeDue: t0.Add(time.Second)}, false},
	}
	for _, tc := range cases {
		if got := tc.w.IsDue(t0, t0); got != tc.want {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestRetireOrder(t *testing.T) {
	p := pool(0, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 })
	in := []Proxy{
		px("ready-new", "t1", events.ProxyReady, revision(2)),
		px("ready-old", "t1", events.ProxyReady, revision(2), created(3*time.Hour)),
		px("outdated", "t1", events.ProxyReady),
		px("running", "t1", events.ProxyRunning, revision(2)),
		px("requested", "t1", events.ProxyRequested, revision(2)),
		px("provisioning", "t1", events.ProxyProvisioning, revision(2), created(2*time.Hour)),
		px("unhealthy", "t1", events.ProxyUnhealthy, revision(2)),
		px("b-tie", "t1", events.ProxyReady, revision(2)),
	}
	want := []string{"unhealthy", "provisioning", "requested", "outdated", "ready-old", "b-tie", "ready-new", "running"}
	var got []string
	for _, x := range RetireOrder(&p, in) {
		got = append(got, x.ID)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if in[0].ID != "ready-new" {
		t.Error("RetireOrder reordered its input")
	}
}

// TestCleanupCondition: stuck deletes turn a pool's Cleanup condition
// False, naming each proxy, its target, since when it retires and its last
// failure; a pool whose deletes never got stuck does not carry it; one
// that did gets it True again when none is.
func TestCleanupCondition(t *testing.T) {
	stuck := px("a", "t1", events.ProxyRetiring, func(x *Proxy) {
		x.DeleteAttempt, x.RetiringSince, x.DeleteFailure = 4, t0.Add(-10*time.Minute), "permanent: volume busy"
	})
	p := pool(1)
	cs := Conditions(&p, 1, &Found{StuckDeletes: []Proxy{stuck, px("b", "t2", events.ProxyRetiring, func(x *Proxy) { x.RetiringSince = t0 })}}, t0)
	if len(cs) != 4 {
		t.Fatalf("got %d conditions, want 4", len(cs))
	}
	want := events.PoolConditionData{Type: events.ConditionCleanup, Status: events.ConditionFalse, Reason: events.ReasonDeleteStuck,
		Message: "deletes keep failing, their instances may still run: a on local/t1 (retiring since 2026-03-01T11:50:00Z; last failure: permanent: volume busy), " +
			"b on local/t2 (retiring since 2026-03-01T12:00:00Z)"}
	if cs[3] != want {
		t.Errorf("Cleanup:\n got  %+v\n want %+v", cs[3], want)
	}
	if cs := Conditions(&p, 1, &Found{}, t0); len(cs) != 3 {
		t.Errorf("a pool whose deletes never got stuck: got %d conditions, want 3", len(cs))
	}
	p.Conditions = events.SetCondition(nil, want, t0)
	cs = Conditions(&p, 1, &Found{}, t0)
	if len(cs) != 4 || cs[3].Status != events.ConditionTrue || cs[3].Reason != events.ReasonCleanedUp {
		t.Errorf("stuck no more: got %+v, want Cleanup True CleanedUp", cs)
	}
}
