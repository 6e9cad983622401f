package proxmox_test

import (
	"bytes"
	"testing"
	"time"

	"proxyfleet/pkg/cloudinit"
	"proxyfleet/pkg/cloudinit/seedtest"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// TestSeedIsTheOneThatBootedOnKVM creates a VM for the operator seed's
// proxy (the instance name, user-data and guest-agent vendor-data that
// the kvm cloud-image end-to-end test boots) and asserts that the ISO the
// driver uploads to the seeds storage is that seed, byte for byte: both
// backends share pkg/cloudinit, and a backend that rendered its own
// meta-data or dropped the vendor-data would fail here.
func TestSeedIsTheOneThatBootedOnKVM(t *testing.T) {
	seed, booted := seedtest.OperatorSeed(t)
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := spec(seedtest.OperatorProxyID)
	s.UserData = seed.UserData

	s = prepared(ctx, t, d, s)
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	volid := "proxy-seeds:iso/" + s.Name + ".iso"
	uploaded, ok := e.fake.Upload(node, volid)
	if !ok {
		t.Fatalf("no volume %s on %s; seeds: %v", volid, node, e.fake.Volumes(node, "proxy-seeds"))
	}
	if bytes.Equal(uploaded, booted) {
		return
	}
	// Say which file differs.
	_, want, err := seedtest.Files(booted)
	if err != nil {
		t.Fatal(err)
	}
	label, got, err := seedtest.Files(uploaded)
	if err != nil {
		t.Fatalf("the uploaded seed is not an ISO image: %v", err)
	}
	if label != cloudinit.VolumeID {
		t.Errorf("uploaded seed label %q, want %q", label, cloudinit.VolumeID)
	}
	for _, name := range []string{cloudinit.FileMetaData, cloudinit.FileUserData, cloudinit.FileVendorData} {
		if !bytes.Equal(got[name], want[name]) {
			t.Errorf("%s differs from the booted seed's:\n%s\nwant:\n%s", name, got[name], want[name])
		}
	}
	t.Fatalf("the uploaded seed (sha256 %s) is not the booted one (sha256 %s)", seedtest.SHA256(uploaded), seedtest.SHA256(booted))
}
