package cloudinit_test

import (
	"testing"

	"proxyfleet/pkg/cloudinit/seedtest"
)

// TestOperatorSeedGolden pins the operator seed's bytes. The kvm
// cloud-image end-to-end test (make e2e-kvm-cloud) boots this seed and
// checks the seed volume it booted has this sha256; the Proxmox and GCE
// tests check they upload it. A change to the renderer, the guest-agent
// script or testdata/operator-cloud-config.yaml changes the sha: write the
// new one into testdata/operator-seed.sha256 and run make e2e-kvm-cloud,
// which proves the new seed boots.
func TestOperatorSeedGolden(t *testing.T) {
	seedtest.OperatorSeed(t)
}
