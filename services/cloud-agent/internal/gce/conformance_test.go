package gce

import (
	"maps"
	"testing"

	"google.golang.org/api/compute/v1"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
)

// conformancePageSize is the fake's aggregatedList page size in the
// conformance suite: small, so its listing spans pages.
const conformancePageSize = 2

func TestDriverConformance(t *testing.T) {
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			f := newFakeCompute(t, "zone-a")
			f.pageSize = conformancePageSize
			d := newDriver(t, f, "zone-a", nil, nil)
			return agenttest.Backend{
				Driver: d,
				Spec:   func(id string) agent.Spec { return spec(id, 1) },
				Foreign: func(t *testing.T, name string) func() bool {
					// Someone's instance named as a proxy's, and a proxy
					// instance of another entry.
					foreign := map[string]map[string]string{
						name:       {"team": "web"},
						"px-other": {LabelProxy: "o0", LabelPool: "p", LabelEntry: "gce-us", LabelPort: "3128"},
					}
					for n, labels := range foreign {
						f.put("zone-a", &compute.Instance{Name: n, Status: "RUNNING", Labels: maps.Clone(labels)})
					}
					return func() bool {
						for n, labels := range foreign {
							if inst := f.instance("zone-a", n); inst == nil || inst.Status != "RUNNING" || !maps.Equal(inst.Labels, labels) {
								return false
							}
						}
						return true
					}
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					stopBehindTheBack(t, d, "zone-a", ref.Name)
					return "instance is TERMINATED"
				},
			}
		},
		MissingDelete: agent.ErrNotFound,
		PageSize:      conformancePageSize,
	})
}
