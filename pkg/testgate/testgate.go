// Package testgate decides what a test does when a prerequisite (a daemon, a
// binary, a reference file) is missing: skip it, or, when
// PROXYFLEET_REQUIRE_INTEGRATION=1 as in CI, fail it so nothing is silently
// skipped.
package testgate

import (
	"os"
	"os/exec"
	"testing"
)

// EnvRequire is the variable that turns missing prerequisites into failures.
const EnvRequire = "PROXYFLEET_REQUIRE_INTEGRATION"

// Required reports whether missing prerequisites must fail tests.
func Required() bool { return os.Getenv(EnvRequire) == "1" }

// Need skips t (or fails it, when [Required]) unless ok. why says what is
// missing and how to get it.
func Need(t testing.TB, ok bool, why string) {
	t.Helper()
	if ok {
		return
	}
	if Required() {
		t.Fatalf("prerequisite missing (%s=1): %s", EnvRequire, why)
	}
	t.Skipf("prerequisite missing: %s", why)
}

// NeedBinary is [Need] for an executable on PATH; it returns its path.
func NeedBinary(t testing.TB, name, why string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	Need(t, err == nil, name+" not found on PATH: "+why)
	return p
}

// NeedFile is [Need] for a readable file.
func NeedFile(t testing.TB, path, why string) {
	t.Helper()
	_, err := os.Stat(path)
	Need(t, err == nil, path+" is not readable: "+why)
}
