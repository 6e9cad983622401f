package kvm

import (
	"context"
	"testing"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// TestDeadDomainsAreTerminated: a marked domain that is no longer active
// (destroyed behind the agent's back, crashed with on_crash=destroy, or
// never started) is terminated in Get and in List, and List finds it out
// from the listing alone, without a state RPC per domain.
func TestDeadDomainsAreTerminated(t *testing.T) {
	cases := []struct {
		name       string
		stop       bool
		wantGet    agent.State
		wantList   agent.State
		wantDetail string
	}{
		{"running", false, agent.StateRunning, "", ""},
		{"destroyed behind the agent's back", true, agent.StateTerminated, agent.StateTerminated, "domain shut off"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			d, f := newDriver(t)
			s := spec("web-dead")
			if _, err := d.Create(ctx, s); err != nil {
				t.Fatal(err)
			}
			f.Addresses[libvirt.SourceLease] = []libvirt.DomainInterface{{Name: "vnet0", Hwaddr: []string{macFor(s.Name)}, Addrs: []golibvirt.DomainIPAddr{{Addr: "192.168.122.50", Prefix: 24}}}}
			if c.stop {
				if err := f.DomainDestroy(ctx, libvirt.Domain{Name: s.Name}); err != nil {
					t.Fatal(err)
				}
			}
			got, err := d.Get(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name})
			if err != nil || got.State != c.wantGet || got.Detail != c.wantDetail {
				t.Errorf("Get = %+v, %v; want %s with detail %q", got, err, c.wantGet, c.wantDetail)
			}
			states := f.Calls["virDomainGetState"]
			list, err := d.List(ctx)
			if err != nil || len(list) != 1 || list[0].State != c.wantList || list[0].Detail != c.wantDetail {
				t.Errorf("List = %+v, %v; want one with state %q detail %q", list, err, c.wantList, c.wantDetail)
			}
			if n := f.Calls["virDomainGetState"] - states; n != 0 {
				t.Errorf("List made %d state calls, want none", n)
			}
		})
	}
}
