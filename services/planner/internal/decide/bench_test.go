package decide

import (
	"fmt"
	"testing"

	"proxyfleet/pkg/events"
)

// BenchmarkReconcileFullPool is one round's rules over a pool of 10,000
// members, ready but for a few still running, on four targets: what the
// leader pays for each round while a large pool fills and its proxies turn
// running and ready. Its B/op and allocs/op do not depend on the machine's
// load.
func BenchmarkReconcileFullPool(b *testing.B) {
	const size = 10000
	targets := []Target{tg("t1"), tg("t2"), tg("t3"), tg("t4")}
	members := make([]Proxy, 0, size)
	load := map[string]int{}
	for i := range size {
		state := events.ProxyReady
		if i%100 == 0 {
			state = events.ProxyRunning
		}
		t := targets[i%len(targets)]
		members = append(members, px(fmt.Sprintf("p-%05d", i), t.Target, state))
		load[t.Key()]++
	}
	in := &Input{Now: t0, AgeNow: t0, Config: testConfig, Pool: pool(size), Members: members,
		Placement: &Placement{Now: t0, Targets: targets, Load: Load{All: load, Pool: load}, QuotaAvoid: testConfig.QuotaAvoid, CheckMaxAge: testCheckMaxAge}}
	b.ReportAllocs()
	for b.Loop() {
		if plan := Reconcile(in); plan.Found.Active != size || len(plan.Decisions) != 0 {
			b.Fatalf("found %d active, %d decisions; want %d and none", plan.Found.Active, len(plan.Decisions), size)
		}
	}
}
