package decide

import (
	"fmt"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestShares(t *testing.T) {
	cases := []struct {
		size    int
		weights map[string]int
		want    map[string]int
	}{
		{10, map[string]int{"eu": 50, "us": 30, "ap": 20}, map[string]int{"eu": 5, "us": 3, "ap": 2}},
		{3, map[string]int{"eu": 80, "us": 20}, map[string]int{"eu": 2, "us": 1}},
		{2, map[string]int{"eu": 80, "us": 20}, map[string]int{"eu": 2, "us": 0}},
		// 1.5 each: the tie goes to the first name.
		{3, map[string]int{"eu": 1, "us": 1}, map[string]int{"eu": 2, "us": 1}},
		// 3.5 and 1.5 and 5: the tie on .5 goes to the larger weight.
		{10, map[string]int{"a": 3, "b": 7, "c": 10}, map[string]int{"a": 1, "b": 4, "c": 5}},
		{0, map[string]int{"eu": 1}, map[string]int{"eu": 0}},
		{7, map[string]int{"a": 1, "b": 1, "c": 1}, map[string]int{"a": 3, "b": 2, "c": 2}},
	}
	for _, tc := range cases {
		got := Shares(tc.size, tc.weights)
		sum := 0
		for v, n := range tc.want {
			if got[v] != n {
				t.Errorf("Shares(%d, %v)[%s] = %d, want %d (all: %v)", tc.size, tc.weights, v, got[v], n, got)
			}
			sum += got[v]
		}
		if sum != tc.size {
			t.Errorf("Shares(%d, %v) sums to %d, want the size", tc.size, tc.weights, sum)
		}
	}
}

// onTarget is n ready proxies "<prefix>0".. on target, the first the
// oldest (created n hours before t0, one hour apart).
func onTarget(prefix, target string, n int, opts ...func(*Proxy)) []Proxy {
	out := make([]Proxy, 0, n)
	for i := range n {
		out = append(out, px(fmt.Sprintf("%s%d", prefix, i), target, events.ProxyReady, append([]func(*Proxy){created(time.Duration(n-i) * time.Hour)}, opts...)...))
	}
	return out
}

func members(groups ...[]Proxy) []Proxy {
	var out []Proxy
	for _, g := range groups {
		out = append(out, g...)
	}
	return out
}

func TestReconcileRebalance(t *testing.T) {
	w532 := placed(events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 50, "us": 30, "ap": 20}}}})
	three := []Target{lt("a1", "region=ap"), lt("e1", "region=eu"), lt("u1", "region=us")}
	noAP := []Target{lt("e1", "region=eu"), lt("u1", "region=us")}
	cases := []struct {
		reconcileCase
		short string // the plan's SpreadShort
	}{
		{reconcileCase: reconcileCase{name: "weights changed: one move, from the most over-share value to the most under-share one, the oldest first",
			pool: pool(10, w532), targets: three, members: members(onTarget("e", "e1", 8), onTarget("u", "u1", 2)),
			want: []string{`create on a1 replacing e0 "rebalance: region=eu holds 8 of 10, its share is 5; region=ap holds 0, its share is 2" +note`}}},
		{reconcileCase: reconcileCase{name: "a value returned: its share comes back, one move at a time",
			pool: pool(10, w532), targets: three, members: members(onTarget("e", "e1", 6), onTarget("u", "u1", 4)),
			want: []string{`create on a1 replacing e0 "rebalance: region=eu holds 6 of 10, its share is 5; region=ap holds 0, its share is 2" +note`}}},
		{reconcileCase: reconcileCase{name: "a value without a live target: nothing moves, Placed names it",
			pool: pool(10, w532), targets: noAP, members: members(onTarget("e", "e1", 6), onTarget("u", "u1", 4))},
			short: "region=ap has 0 of its share 2: no live target with region=ap"},
		{reconcileCase: reconcileCase{name: "a value whose target is full: nothing moves, Placed names the capacity",
			pool: pool(10, w532), targets: []Target{capped(lt("a1", "region=ap"), 1), lt("e1", "region=eu"), lt("u1", "region=us")},
			members: members(onTarget("e", "e1", 6), onTarget("u", "u1", 3), onTarget("a", "a1", 1))},
			short: "region=ap has 1 of its share 2: its targets are at capacity: a1 (1 of 1)"},
		{reconcileCase: reconcileCase{name: "a value whose target lacks the image: Placed says so",
			pool:    pool(10, w532, func(p *Pool) { p.Spec.Image = "debian" }),
			targets: []Target{offers(lt("a1", "region=ap"), []string{"alpine"}, nil), offers(lt("e1", "region=eu"), []string{"debian"}, nil), offers(lt("u1", "region=us"), []string{"debian"}, nil)},
			members: members(onTarget("e", "e1", 6), onTarget("u", "u1", 4))},
			short: "region=ap has 0 of its share 2: no live target with region=ap offers image debian"},
		{reconcileCase: reconcileCase{name: "already on share: nothing moves",
			pool: pool(10, w532), targets: three, members: members(onTarget("e", "e1", 5), onTarget("u", "u1", 3), onTarget("a", "a1", 2))}},
		{reconcileCase: reconcileCase{name: "on share within rounding: nothing moves",
			pool:    pool(3, placed(events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 1, "us": 1}}}})),
			targets: noAP, members: members(onTarget("e", "e1", 1), onTarget("u", "u1", 2))}},
		{reconcileCase: reconcileCase{name: "one rebalance at a time: none while one is in flight",
			pool: pool(10, w532), targets: three,
			members: members(onTarget("e", "e1", 1, replacedBy("r", "rebalance: region=eu holds 8 of 10, its share is 5")), onTarget("f", "e1", 7), onTarget("u", "u1", 2),
				[]Proxy{px("r", "a1", events.ProxyRequested)})}},
		{reconcileCase: reconcileCase{name: "a rebalance in flight retires its member once the new proxy is ready",
			pool: pool(10, w532), targets: three,
			members: members(onTarget("e", "e1", 1, replacedBy("r", "rebalance: region=eu holds 8 of 10, its share is 5")), onTarget("f", "e1", 7), onTarget("u", "u1", 2),
				[]Proxy{px("r", "a1", events.ProxyReady)}),
			want: []string{`retire e0 "rebalance: region=eu holds 8 of 10, its share is 5" by=r`}}},
		{reconcileCase: reconcileCase{name: "not while below size: the fill places on the most under-share value",
			pool: pool(10, w532), targets: three, members: members(onTarget("e", "e1", 7), onTarget("u", "u1", 2)),
			want: []string{"create on a1"}}},
		{reconcileCase: reconcileCase{name: "not while rolling, and a roll waits for a rebalance in flight",
			pool: pool(10, w532, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }), targets: three,
			members: members(onTarget("e", "e1", 1, replacedBy("r", "rebalance: region=eu holds 8 of 10, its share is 5")), onTarget("f", "e1", 7, revision(2)), onTarget("u", "u1", 2, revision(2)),
				[]Proxy{px("r", "a1", events.ProxyRequested, revision(2))})}},
		{reconcileCase: reconcileCase{name: "rolling: the roll goes first, no rebalance beside it",
			pool: pool(10, w532, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }), targets: three,
			members: members(onTarget("e", "e1", 8), onTarget("u", "u1", 2, revision(2))),
			want:    []string{`create on a1 replacing e0 "rolled: spec revision 2" +note`}}},
		{reconcileCase: reconcileCase{name: "a roll step in a spread pool replaces a member on its own value",
			pool:    pool(3, func(p *Pool) { p.Revision, p.ShapeRevision = 2, 2 }, placed(events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 2, "us": 1}}}})),
			targets: noAP, members: members(onTarget("e", "e1", 2), onTarget("u", "u1", 1, revision(2))),
			want: []string{`create on e1 replacing e0 "rolled: spec revision 2" +note`}}},
		{reconcileCase: reconcileCase{name: "a sick member's replacement goes to its value",
			pool:    pool(3, placed(events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 2, "us": 1}}}})),
			targets: noAP, members: members(onTarget("e", "e1", 1), onTarget("s", "e1", 1, func(x *Proxy) {
				x.State = events.ProxyUnhealthy
				x.UnhealthySince = t0.Add(-3 * time.Minute)
				x.Reason = "probe failed"
			}), onTarget("u", "u1", 1)),
			want: []string{`create on e1 replacing s0 "unhealthy: probe failed"`}}},
		{reconcileCase: reconcileCase{name: "require narrowed: a member on an excluded value moves",
			pool:    pool(2, placed(events.Placement{Require: map[string][]string{"country": {"de"}}})),
			targets: []Target{lt("d1", "country=de"), lt("f1", "country=fr")},
			members: members(onTarget("d", "d1", 1), onTarget("f", "f1", 1)),
			want:    []string{`create on d1 replacing f0 "rebalance: country=fr is not in placement.require (country in [de])" +note`}}},
		{reconcileCase: reconcileCase{name: "require narrowed with nowhere to go: nothing moves",
			pool:    pool(2, placed(events.Placement{Require: map[string][]string{"country": {"de"}}})),
			targets: []Target{capped(lt("d1", "country=de"), 1), lt("f1", "country=fr")},
			members: members(onTarget("d", "d1", 1), onTarget("f", "f1", 1))}},
		{reconcileCase: reconcileCase{name: "a value no spread weighs any more counts as over-share",
			pool:    pool(3, placed(events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 2, "us": 1}}}})),
			targets: three, members: members(onTarget("a", "a1", 1), onTarget("e", "e1", 1), onTarget("u", "u1", 1)),
			want: []string{`create on e1 replacing a0 "rebalance: region=ap has no weight in the spread" +note`}}},
		{reconcileCase: reconcileCase{name: "a member on a gone target counts by its recorded labels",
			pool: pool(10, w532), targets: three,
			members: members(onTarget("e", "e1", 5), onTarget("g", "gone", 1, labelled("region=us")), onTarget("u", "u1", 2), onTarget("a", "a1", 2))}},
		{reconcileCase: reconcileCase{name: "a later spread moves only within the earlier one's values",
			pool: pool(4, placed(events.Placement{Spread: []events.Spread{
				{Label: "region", Weights: map[string]int{"eu": 1, "us": 1}},
				{Label: "country", Weights: map[string]int{"de": 1, "fr": 1, "us": 2}},
			}})),
			targets: []Target{lt("d1", "region=eu,country=de"), lt("f1", "region=eu,country=fr"), lt("u1", "region=us,country=us")},
			members: members(onTarget("d", "d1", 2), onTarget("u", "u1", 2)),
			want:    []string{`create on f1 replacing d0 "rebalance: country=de holds 2 of 4, its share is 1; country=fr holds 0, its share is 1" +note`}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			plan := tc.run(t)
			if plan.Found.SpreadShort != tc.short {
				t.Errorf("SpreadShort = %q, want %q", plan.Found.SpreadShort, tc.short)
			}
			if tc.short != "" {
				cs := Conditions(&tc.pool, plan.Want, &plan.Found, t0)
				want := "False SpreadUnmet: spread: " + tc.short
				if got := cs[1].Status + " " + cs[1].Reason + ": " + cs[1].Message; got != want {
					t.Errorf("Placed = %q, want %q", got, want)
				}
			}
		})
	}
}

func TestReconcileOverTwoEntries(t *testing.T) {
	two := func(p *Pool) {
		p.Spec.Placement = &events.Placement{Entries: []string{"cloud"},
			Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 1, "us": 1}}}}
	}
	c1 := lt("c1", "region=us")
	c1.Entry = "cloud"
	o1 := lt("o1", "region=us")
	o1.Entry = "other"
	cases := []reconcileCase{
		{name: "a pool places over the targets of both entries, spread across them", pool: pool(4, two),
			targets: []Target{c1, lt("e1", "region=eu"), o1},
			want:    []string{"create on c1", "create on e1", "create on c1", "create on e1"}},
		{name: "an entry of neither: its targets take nothing; the message names both entries", pool: pool(1, two),
			targets: []Target{o1}, known: []string{"local/e1"},
			miss: events.ReasonNoLiveTarget, missText: "no live agent of entries local, cloud"},
		{name: "a pool without a placement never moves members", pool: pool(2),
			targets: []Target{c1, lt("e1", "region=eu"), lt("e2", "region=eu")},
			members: []Proxy{px("a", "c1", events.ProxyReady, func(x *Proxy) { x.Entry = "cloud" }), px("b", "e1", events.ProxyReady)}},
		{name: "an entry dropped from a pool with a placement: its members move", pool: pool(2, placed(events.Placement{})),
			targets: []Target{c1, lt("e1", "region=eu"), lt("e2", "region=eu")},
			members: []Proxy{px("a", "c1", events.ProxyReady, func(x *Proxy) { x.Entry = "cloud" }), px("b", "e1", events.ProxyReady)},
			want:    []string{`create on e2 replacing a "rebalance: entry cloud is not one of the pool's entries (local)" +note`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { tc.run(t) })
	}
}
