package gce

import (
	"testing"

	"proxyfleet/pkg/cloudinit"
	"proxyfleet/pkg/cloudinit/seedtest"
)

// TestUserDataIsTheBootedSeeds creates the operator seed's proxy (the
// instance name and user-data the kvm cloud-image end-to-end test boots)
// and asserts that the user-data in the instance's metadata, which the
// GCE datasource hands to cloud-init as the NoCloud seed's user-data file
// is on kvm, is that file byte for byte. GCE has no seed ISO and no
// vendor-data: its images run Google's guest environment, and the address
// comes from the Compute API, so the guest-agent bootstrap is not needed.
func TestUserDataIsTheBootedSeeds(t *testing.T) {
	_, booted := seedtest.OperatorSeed(t)
	_, files, err := seedtest.Files(booted)
	if err != nil {
		t.Fatal(err)
	}
	want := files[cloudinit.FileUserData]
	if len(want) == 0 {
		t.Fatal("the booted seed has no user-data")
	}
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec(seedtest.OperatorProxyID, 1)
	s.UserData = seedtest.OperatorUserData(t)
	if _, err := d.Create(ctx(t), s); err != nil {
		t.Fatal(err)
	}
	items := f.instance("zone-a", s.Name).Metadata.Items
	var got *string
	for _, it := range items {
		if it.Key == MetadataUserData {
			got = it.Value
		}
	}
	if got == nil {
		t.Fatalf("no %s in the instance's metadata: %+v", MetadataUserData, items)
	}
	if *got != string(want) {
		t.Fatalf("metadata user-data (sha256 %s) is not the booted seed's user-data (sha256 %s):\n%s", seedtest.SHA256([]byte(*got)), seedtest.SHA256(want), *got)
	}
}
