package proxmox_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

func TestDriverConformance(t *testing.T) {
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			e := newEnv(t, pvetest.Options{})
			return agenttest.Backend{
				Driver: e.driver(),
				Spec:   spec,
				Foreign: func(t *testing.T, name string) func() bool {
					// Someone's VM named as a proxy's, and a proxy VM of
					// another entry.
					foreign := map[int]string{200: name, 201: "other-entry"}
					e.fake.AddVM(node, 200, name, nil)
					e.fake.AddVM(node, 201, "other-entry", map[string]string{"tags": "proxyfleet;pf-entry-elsewhere;pf-pool-web;pf-proxy-web-x"})
					return func() bool {
						left := 0
						for _, v := range e.fake.VMs() {
							if foreign[v.VMID] != "" && v.Conf["name"] == foreign[v.VMID] {
								left++
							}
						}
						return left == len(foreign)
					}
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					vmid, err := strconv.Atoi(ref.ProviderID)
					if err != nil {
						t.Fatalf("provider ID %q: %v", ref.ProviderID, err)
					}
					e.stopVM(t, vmid)
					return "VM is stopped"
				},
			}
		},
		MissingDelete: nil, // nothing marked at the VMID or by the name: nothing to do
	})
}

// stopVM stops VM vmid through the API, as an operator or HA would, and
// waits for the task.
func (e *env) stopVM(t *testing.T, vmid int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pve.New(pve.Config{URL: e.cfg.APIURL, TokenFile: e.cfg.TokenFile, Fingerprint: e.cfg.Fingerprint, TaskPollInterval: time.Duration(e.cfg.TaskPollInterval)})
	if err != nil {
		t.Fatal(err)
	}
	upid, err := c.Stop(ctx, node, vmid)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.WaitTask(ctx, upid); err != nil {
		t.Fatal(err)
	}
}
