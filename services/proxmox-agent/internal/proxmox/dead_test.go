package proxmox_test

import (
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// TestListStateOfVMs: a proxy's running VM is provisioning in List (its
// address needs the guest agent), and a VM on a node the cluster has no
// word from is no verdict. One stopped behind the agent's back is
// terminated: the conformance suite's StoppedIsTerminated.
func TestListStateOfVMs(t *testing.T) {
	cases := []struct {
		name       string
		offline    bool
		wantList   agent.State
		wantDetail string
	}{
		{"running", false, agent.StateProvisioning, "VM is running"},
		{"node offline", true, "", "VM is unknown"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, pvetest.Options{})
			d := e.driver()
			ctx := ctxT(t, 30*time.Second)
			s := prepared(ctx, t, d, spec("web-deaddead00"))
			id := s.ProviderID
			if _, err := d.Create(ctx, s); err != nil {
				t.Fatal(err)
			}
			ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id}
			waitRunning(t, ctx, d, ref)
			if c.offline {
				e.fake.SetNodeOnline(node, false)
			}
			list, err := d.List(ctx)
			if err != nil || len(list) != 1 || list[0].State != c.wantList || list[0].Detail != c.wantDetail {
				t.Errorf("List = %+v, %v; want one %q with detail %q", list, err, c.wantList, c.wantDetail)
			}
		})
	}
}
