//go:build integration

package integration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// TestDriverConformance runs the conformance suite against the real
// libvirtd; every subtest has an entry of its own.
func TestDriverConformance(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			entry := randomEntry(t)
			cleanupEntry(t, pool, entry)
			stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{})
			t.Cleanup(stack.Close)
			t.Cleanup(func() { deleteListed(t, stack.Driver) })
			return agenttest.Backend{
				Driver: stack.Driver,
				Spec:   func(proxyID string) agent.Spec { return spec(entry, proxyID) },
				Foreign: func(t *testing.T, name string) func() bool {
					defineUnmarked(t, name)
					return func() bool { return domState(t, name) == "shut off" }
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					if out, err := virsh(t, "destroy", ref.Name); err != nil {
						t.Fatalf("destroy: %v %s", err, out)
					}
					return "domain shut off"
				},
			}
		},
		MissingDelete: nil, // a domain and volumes already gone are fine
		NoBoot:        "the test image is an empty disk: no guest boots to report an address",
	})
}

// defineUnmarked defines a domain without the proxyfleet marker, as
// another tool would, until the end of the test.
func defineUnmarked(t *testing.T, name string) {
	t.Helper()
	xmlPath := filepath.Join(t.TempDir(), "unmarked.xml")
	doc := "<domain type='qemu'><name>" + name + "</name><memory unit='MiB'>64</memory><os><type arch='x86_64' machine='q35'>hvm</type></os></domain>"
	if err := os.WriteFile(xmlPath, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := virsh(t, "define", xmlPath); err != nil {
		t.Fatalf("define unmarked %s: %v %s", name, err, out)
	}
	t.Cleanup(func() { _, _ = virsh(t, "undefine", name) })
}

// deleteListed deletes every instance the driver lists: what a subtest
// created, with its volumes.
func deleteListed(t *testing.T, d *kvm.Driver) {
	ctx := context.Background()
	list, err := d.List(ctx)
	if err != nil {
		t.Errorf("cleanup: list: %v", err)
		return
	}
	for _, inst := range list {
		if err := d.Delete(ctx, agent.Ref{ProxyID: inst.Marker.ProxyID, Name: inst.Name}); err != nil {
			t.Errorf("cleanup: delete %s: %v", inst.Name, err)
		}
	}
}
