package lifecycletest_test

import (
	"maps"
	"testing"

	"proxyfleet/pkg/events/lifecycletest"
)

// The states every reader must reach on the adversarial sequences, written
// out.
func TestAdversarialWant(t *testing.T) {
	got := lifecycletest.Want(lifecycletest.Adversarial("x"))
	want := map[string]string{
		"x-retfail":   "retiring",
		"x-failrun":   "failed",
		"x-failready": "failed",
		"x-retrun":    "retiring",
		"x-reqprov":   "running",
		"x-reqreq":    "provisioning",
		"x-deadreq":   "deleted",
		"x-abreq":     "abandoned",
		"x-delfirst":  "provisioning",
		"x-failfail":  "deleted",
		"x-obsfirst":  "ready",
		"x-readyunh":  "unhealthy",
		"x-wrong":     "requested",
		"x-forged":    "running",
		"x-baddata":   "provisioning",
	}
	if !maps.Equal(got, want) {
		t.Errorf("Want(Adversarial) =\n%v\nwant\n%v", got, want)
	}
}

// A seed always gives the same sequence, and different seeds differ.
func TestSequenceIsDeterministic(t *testing.T) {
	a, b, c := lifecycletest.Sequence("p", 7, 50), lifecycletest.Sequence("p", 7, 50), lifecycletest.Sequence("p", 8, 50)
	if len(a) != 50 {
		t.Fatalf("len = %d; want 50", len(a))
	}
	same := func(x, y []lifecycletest.Event) bool {
		for i := range x {
			if x[i].ID != y[i].ID || x[i].Kind != y[i].Kind || x[i].Source != y[i].Source || x[i].MsgID != y[i].MsgID {
				return false
			}
		}
		return true
	}
	if !same(a, b) {
		t.Error("seed 7 gave two different sequences")
	}
	if same(a, c) {
		t.Error("seeds 7 and 8 gave the same sequence")
	}
}
