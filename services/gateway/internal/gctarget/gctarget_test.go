package gctarget_test

import (
	"os"
	"runtime/debug"
	"testing"

	"proxyfleet/services/gateway/internal/gctarget"
)

// current returns the GC target in effect, leaving it so.
func current() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

func TestApplySetsPercentWithoutGOGC(t *testing.T) {
	// t.Setenv restores GOGC when the test ends; then it is unset.
	t.Setenv("GOGC", "")
	if err := os.Unsetenv("GOGC"); err != nil {
		t.Fatal(err)
	}
	defer debug.SetGCPercent(current())
	debug.SetGCPercent(100)
	if got := gctarget.Apply(); got != gctarget.Percent {
		t.Fatalf("Apply() = %d, want %d", got, gctarget.Percent)
	}
	if got := current(); got != gctarget.Percent {
		t.Fatalf("GC target after Apply: %d, want %d", got, gctarget.Percent)
	}
}

func TestApplyKeepsGOGC(t *testing.T) {
	t.Setenv("GOGC", "150")
	defer debug.SetGCPercent(current())
	// The runtime read GOGC when the process started; stand in for it.
	debug.SetGCPercent(150)
	if got := gctarget.Apply(); got != 150 {
		t.Fatalf("Apply() with GOGC=150 = %d, want 150 kept", got)
	}
	if got := current(); got != 150 {
		t.Fatalf("GC target after Apply with GOGC=150: %d, want 150", got)
	}
}
