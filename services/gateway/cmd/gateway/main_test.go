package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestParseRefusesABadOriginCA: a missing, unreadable or PEM-less
// --origin-ca stops the gateway at start, naming the flag.
func TestParseRefusesABadOriginCA(t *testing.T) {
	dir := t.TempDir()
	noPEM := filepath.Join(dir, "bundle.pem")
	if err := os.WriteFile(noPEM, []byte("nothing here\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ file, says string }{
		{filepath.Join(dir, "missing.pem"), "no such file"},
		{noPEM, "holds no PEM certificate"},
		{dir, "is a directory"},
	} {
		_, err := parse([]string{"--nats-url", "nats://127.0.0.1:4222", "--origin-ca", c.file})
		if err == nil || !strings.Contains(err.Error(), "--origin-ca") || !strings.Contains(err.Error(), c.says) {
			t.Errorf("--origin-ca %s: %v; want a start error naming the flag and saying %q", c.file, err, c.says)
		}
	}
	f, err := parse([]string{"--nats-url", "nats://127.0.0.1:4222", "--ca-out", filepath.Join(dir, "ca.pem")})
	if err != nil || f.originRoots == nil || f.caOut == "" {
		t.Errorf("without --origin-ca: %v; want the system roots and --ca-out kept", err)
	}
}
