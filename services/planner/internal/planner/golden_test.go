package planner

import (
	"encoding/json"
	"log/slog"
	"reflect"
	"sort"
	"strings"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// TestGoldenLogsFold: every release's golden event log
// (pkg/events/testdata/golden-<version>, written by that release's
// binaries: make golden-log) loaded into a fresh stream is folded by
// today's planner with every event readable and none refused or skipped
// (no warning), into the pools and live proxies the release's views hold,
// each proxy's fields equal where both versions have them.
func TestGoldenLogsFold(t *testing.T) {
	for _, version := range bustest.GoldenVersions(t) {
		t.Run(version, func(t *testing.T) {
			c := bustest.Start(t)
			g := bustest.ReadGolden(t, version)
			g.Load(t, c)
			evs := streamEvents(t, c, 0)
			if len(evs) != len(g.Msgs) {
				t.Fatalf("%d events read back, the golden log has %d", len(evs), len(g.Msgs))
			}
			rec := &bustest.Warnings{}
			st := newState(slog.New(rec), defaultKeepFinished)
			for _, ev := range evs {
				if ev.Unreadable != nil {
					t.Errorf("event %d (%s %s %s) is unreadable: %v", ev.Seq, ev.Aggregate, ev.ID, ev.Kind, ev.Unreadable)
				}
				st.apply(ev)
			}
			if w := rec.Lines(); len(w) > 0 {
				t.Errorf("the fold of %s's log warned %d times (an event refused or skipped):\n%s", version, len(w), strings.Join(w, "\n"))
			}
			if st.seq != evs[len(evs)-1].Seq {
				t.Errorf("the fold reached %d, the log ends at %d", st.seq, evs[len(evs)-1].Seq)
			}

			// Pools: the release's fleet-pools, by name, with their spec.
			var pools []string
			for name, p := range st.pools {
				if !p.Deleted {
					pools = append(pools, name)
				}
			}
			wantPools := sortedKeys(g.Views[bus.BucketPools])
			sort.Strings(pools)
			if !reflect.DeepEqual(pools, wantPools) {
				t.Errorf("pools after the fold %v, the release's views %v", pools, wantPools)
			}
			for _, name := range wantPools {
				var want struct {
					Spec *events.PoolSpec `json:"spec"`
				}
				if err := json.Unmarshal(g.Views[bus.BucketPools][name], &want); err != nil {
					t.Fatal(err)
				}
				if p := st.pools[name]; p != nil && want.Spec != nil && (p.Spec.Size != want.Spec.Size || p.Spec.Provider != want.Spec.Provider) {
					t.Errorf("pool %s: size %d on %s after the fold, the release's view says %d on %s", name, p.Spec.Size, p.Spec.Provider, want.Spec.Size, want.Spec.Provider)
				}
			}

			// Proxies: the live ones are the release's fleet-proxies, each
			// field both versions have equal.
			var live []string
			for id, x := range st.proxies {
				if !events.IsTerminal(x.State) {
					live = append(live, id)
				}
			}
			sort.Strings(live)
			wantProxies := sortedKeys(g.Views[bus.BucketProxies])
			if !reflect.DeepEqual(live, wantProxies) {
				t.Fatalf("live proxies after the fold %v, the release's views %v", live, wantProxies)
			}
			for _, id := range live {
				b, err := json.Marshal(st.proxies[id].ProxyView)
				if err != nil {
					t.Fatal(err)
				}
				var got, want map[string]any
				_ = json.Unmarshal(b, &got)
				if err := json.Unmarshal(g.Views[bus.BucketProxies][id], &want); err != nil {
					t.Fatal(err)
				}
				shared := 0
				for f, w := range want {
					if v, ok := got[f]; ok {
						shared++
						if !reflect.DeepEqual(v, w) {
							t.Errorf("proxy %s: %s = %v after the fold, the release's view has %v", id, f, v, w)
						}
					}
				}
				if shared < 3 {
					t.Errorf("proxy %s shares %d fields with the release's view: %s vs %s", id, shared, b, g.Views[bus.BucketProxies][id])
				}
			}
			if !t.Failed() {
				t.Logf("%s: %d events folded; %d pools and %d live proxies as the release's views", version, len(evs), len(pools), len(live))
			}
		})
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
