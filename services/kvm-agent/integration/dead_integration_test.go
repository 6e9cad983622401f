//go:build integration

package integration

import (
	"context"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// TestDestroyedDomainIsTerminated checks on a real libvirtd what List
// relies on: virConnectListAllDomains gives an inactive domain the id -1,
// so a domain destroyed behind the agent's back is terminated in List (no
// state RPC) and in Get.
func TestDestroyedDomainIsTerminated(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	entry := randomEntry(t)
	s := spec(entry, "web-destroyed")
	cleanupEntry(t, pool, entry, s.Name)
	stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{})
	defer stack.Close()
	ctx := context.Background()
	if _, err := stack.Driver.Create(ctx, s); err != nil {
		t.Fatalf("Create: %v", err)
	}
	list, err := stack.Driver.List(ctx)
	if err != nil || len(list) != 1 || list[0].State == agent.StateTerminated {
		t.Fatalf("List of a running domain = %+v, %v; want it not terminated", list, err)
	}
	if out, err := virsh(t, "destroy", s.Name); err != nil {
		t.Fatalf("destroy: %v %s", err, out)
	}
	list, err = stack.Driver.List(ctx)
	if err != nil || len(list) != 1 || list[0].State != agent.StateTerminated || list[0].Detail != "domain shut off" {
		t.Fatalf("List after destroy = %+v, %v; want terminated, domain shut off", list, err)
	}
	got, err := stack.Driver.Get(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name})
	if err != nil || got.State != agent.StateTerminated || got.Detail != "domain shut off" {
		t.Fatalf("Get after destroy = %+v, %v; want terminated, domain shut off", got, err)
	}
	if err := stack.Driver.Delete(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
}
