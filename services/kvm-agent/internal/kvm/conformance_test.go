package kvm

import (
	"context"
	"testing"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// TestDriverConformance runs the conformance suite against the fake host;
// services/kvm-agent/integration runs it against a real libvirtd.
func TestDriverConformance(t *testing.T) {
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			d, f := newDriver(t)
			return agenttest.Backend{
				Driver: d,
				Spec:   spec,
				Foreign: func(t *testing.T, name string) func() bool {
					// Someone's domain named as a proxy's, and a proxy
					// domain of another entry.
					other := params(false)
					other.Name, other.Marker.Entry = "px-other", "kvm-other"
					foreign := map[string]string{name: "<domain><name>" + name + "</name></domain>", other.Name: domainXML(other)}
					for n, xml := range foreign {
						f.DefineRaw(n, xml)
					}
					return func() bool {
						for n, want := range foreign {
							if xml, _, ok := f.DomainXML(n); !ok || xml != want {
								return false
							}
						}
						return true
					}
				},
				Boot: func(t *testing.T, ref agent.Ref) {
					// The network's DHCP server leases the domain an address.
					f.Addresses[libvirt.SourceLease] = []libvirt.DomainInterface{{Name: "vnet0", Hwaddr: []string{macFor(ref.Name)},
						Addrs: []golibvirt.DomainIPAddr{{Addr: "192.168.122.50", Prefix: 24}}}}
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					if err := f.DomainDestroy(context.Background(), libvirt.Domain{Name: ref.Name}); err != nil {
						t.Fatal(err)
					}
					return "domain shut off"
				},
			}
		},
		MissingDelete: nil, // a domain and volumes already gone are fine
	})
}
