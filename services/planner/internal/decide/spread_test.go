package decide

import (
	"testing"

	"proxyfleet/pkg/events"
)

// lt is target name of entry local with labels given as "k=v,k=v".
func lt(name, labels string) Target {
	t := tg(name)
	if labels != "" {
		m, err := events.ParseLabels(labels)
		if err != nil {
			panic(err)
		}
		t.Labels = m
	}
	return t
}

// placed gives pool p placement pm.
func placed(pm events.Placement) func(*Pool) {
	return func(p *Pool) { p.Spec.Placement = &pm }
}

// labelled gives a proxy the labels "k=v,k=v".
func labelled(labels string) func(*Proxy) {
	return func(x *Proxy) { x.Labels = lt("", labels).Labels }
}

func TestReconcilePlacementByLabels(t *testing.T) {
	deFr := events.Placement{Require: map[string][]string{"country": {"de", "fr"}}}
	euUS := events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 80, "us": 20}}}}
	regions := []Target{lt("e1", "region=eu,country=de"), lt("e2", "region=eu,country=fr"), lt("u1", "region=us,country=us"), lt("n1", "")}
	cases := []reconcileCase{
		{name: "require keeps the pool on matching targets", pool: pool(3, placed(deFr)), targets: regions,
			want: []string{"create on e1", "create on e2", "create on e1"}},
		{name: "require that no live target matches: the condition says which labels", pool: pool(1, placed(
			events.Placement{Require: map[string][]string{"country": {"it"}}})), targets: regions,
			miss: events.ReasonNoTargetMatchesLabels, missText: "country in [it]; considered: e1 (country=de, region=eu), e2 (country=fr, region=eu), u1 (country=us, region=us), n1 (no labels)"},
		{name: "spread 80/20 over five proxies", pool: pool(5, placed(euUS)), targets: regions,
			want: []string{"create on e1", "create on e2", "create on e1", "create on u1", "create on e2"}},
		{name: "spread 80/20 over ten proxies: two go to us", pool: pool(10, placed(euUS)), targets: regions,
			// eu's share is ahead until six are placed there; a tie goes
			// to the least loaded target.
			want: []string{"create on e1", "create on e2", "create on e1", "create on e2", "create on e1", "create on e2", "create on u1", "create on e1", "create on u1", "create on e2"}},
		{name: "spread: a new proxy goes to the value furthest below its share", pool: pool(5, placed(euUS)), targets: regions,
			members: []Proxy{px("a", "e1", events.ProxyReady), px("b", "e2", events.ProxyReady), px("c", "e1", events.ProxyReady), px("d", "e2", events.ProxyReady)},
			want:    []string{"create on u1"}},
		{name: "spread counts proxies on a gone target by their recorded labels", pool: pool(5, placed(euUS)), targets: regions,
			members: []Proxy{px("a", "gone", events.ProxyReady, labelled("region=us")), px("b", "e1", events.ProxyReady), px("c", "e2", events.ProxyReady), px("d", "e1", events.ProxyReady)},
			want:    []string{"create on e2"}},
		{name: "spread: a value without a live target gives its share to the others", pool: pool(3, placed(euUS)),
			targets: []Target{lt("e1", "region=eu"), lt("n1", "")},
			want:    []string{"create on e1", "create on e1", "create on e1"}},
		{name: "spread: a full value gives way to the next", pool: pool(3, placed(euUS)),
			targets: []Target{capped(lt("e1", "region=eu"), 1), lt("u1", "region=us")},
			want:    []string{"create on e1", "create on u1", "create on u1"}},
		{name: "spread with nowhere to go names capacity and the values short of their share", pool: pool(5, placed(euUS)),
			targets: []Target{capped(lt("e1", "region=eu"), 1), lt("n1", "")},
			want:    []string{"create on e1"},
			miss:    events.ReasonCapacityExhausted, missText: "e1 (1 of 1); spread: region=eu has 1 of its share 4: its targets are at capacity: e1 (1 of 1); region=us has 0 of its share 1: no live target with region=us"},
		{name: "spread over a label no target carries", pool: pool(1, placed(euUS)), targets: []Target{lt("n1", "country=de")},
			miss: events.ReasonNoTargetMatchesLabels, missText: "region in [eu, us] (spread); considered: n1 (country=de)"},
		{name: "two spreads: the first decides, the second splits within it", pool: pool(4, placed(events.Placement{Spread: []events.Spread{
			{Label: "region", Weights: map[string]int{"eu": 1}},
			{Label: "country", Weights: map[string]int{"de": 3, "fr": 1}},
		}})), targets: regions,
			want: []string{"create on e1", "create on e1", "create on e2", "create on e1"}},
		{name: "require and spread together", pool: pool(2, placed(events.Placement{Require: deFr.Require,
			Spread: []events.Spread{{Label: "country", Weights: map[string]int{"de": 1, "fr": 1}}}})), targets: regions,
			want: []string{"create on e1", "create on e2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { tc.run(t) })
	}
}

func TestPlaceWithoutPlacementIgnoresLabels(t *testing.T) {
	p := pool(1)
	pl := &Placement{Now: t0, Targets: []Target{lt("a", "region=us"), lt("b", "")}, Load: Load{All: map[string]int{}, Pool: map[string]int{"local.a": 1}}}
	a, ok := Place(pl, &p)
	if !ok || a.Target != "b" {
		t.Fatalf("Place = %s, %v; want b (the least loaded: labels do not matter without a placement)", a.Target, ok)
	}
}
