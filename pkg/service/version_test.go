package service_test

import (
	"bytes"
	"flag"
	"io"
	"testing"

	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/service"
)

// TestVersionFlag: --version prints "<service> <buildinfo.Version>" on
// stdout and exits 0 before the other flags are read, on every command
// line the common flags are registered on.
func TestVersionFlag(t *testing.T) {
	var out bytes.Buffer
	codes := []int{}
	defer service.SetVersionHooks(&out, func(code int) { codes = append(codes, code) })()

	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var f service.Flags
	f.Register(fs, "health")
	if err := fs.Parse([]string{"--version"}); err != nil {
		t.Fatalf("--version: %v", err)
	}
	if want := "health " + buildinfo.Version + "\n"; out.String() != want {
		t.Fatalf("--version printed %q, want %q", out.String(), want)
	}
	if len(codes) != 1 || codes[0] != 0 {
		t.Fatalf("--version exited with %v, want once with 0", codes)
	}

	// An agent's command line (service.Command) has it too.
	out.Reset()
	codes = codes[:0]
	cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", io.Discard)
	if code, ok := cmd.Parse([]string{"--version"}); !ok || code != 0 {
		t.Fatalf("demo-agent --version: parse returned %d, %v", code, ok)
	}
	if want := "demo-agent " + buildinfo.Version + "\n"; out.String() != want || len(codes) != 1 || codes[0] != 0 {
		t.Fatalf("demo-agent --version printed %q and exited %v, want %q and 0", out.String(), codes, want)
	}
}
