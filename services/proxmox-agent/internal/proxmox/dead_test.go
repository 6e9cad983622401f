package proxmox_test

import (
	"strconv"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// TestStoppedVMIsTerminated: a proxy's VM stopped behind the agent's back
// (a stop task through the API, as an operator or HA would run it) is
// terminated in Get and in List; a VM on a node the cluster has no word
// from is not.
func TestStoppedVMIsTerminated(t *testing.T) {
	cases := []struct {
		name       string
		stop       bool
		offline    bool
		wantList   agent.State
		wantDetail string
	}{
		{"running", false, false, agent.StateProvisioning, "VM is running"},
		{"stopped behind the agent's back", true, false, agent.StateTerminated, "VM is stopped"},
		{"node offline", false, true, "", "VM is unknown"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, pvetest.Options{})
			d := e.driver()
			ctx := ctxT(t, 30*time.Second)
			s := spec("web-deaddead00")
			id, err := d.Prepare(ctx, s)
			if err != nil {
				t.Fatal(err)
			}
			s.ProviderID = id
			if _, err := d.Create(ctx, s); err != nil {
				t.Fatal(err)
			}
			ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id}
			waitRunning(t, ctx, d, ref)
			if c.stop {
				c, err := pve.New(pve.Config{URL: e.cfg.APIURL, TokenFile: e.cfg.TokenFile, Fingerprint: e.cfg.Fingerprint, TaskPollInterval: time.Duration(e.cfg.TaskPollInterval)})
				if err != nil {
					t.Fatal(err)
				}
				vmid, _ := strconv.Atoi(id)
				upid, err := c.Stop(ctx, node, vmid)
				if err != nil {
					t.Fatal(err)
				}
				if err := c.WaitTask(ctx, upid); err != nil {
					t.Fatal(err)
				}
				got, err := d.Get(ctx, ref)
				if err != nil || got.State != agent.StateTerminated || got.Detail != "VM is stopped" {
					t.Errorf("Get = %+v, %v; want terminated, VM is stopped", got, err)
				}
			}
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
