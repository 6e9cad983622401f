package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/agentcmd"
)

func TestHelpExplains(t *testing.T) {
	var out strings.Builder
	if code := agentcmd.Main(spec(), []string{"--help"}, &out); code != 0 {
		t.Fatalf("--help exit code %d", code)
	}
	for _, want := range []string{"--config", "type gce", "type kubernetes", "docs/gce.md", "never tokens"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not mention %q", want)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	good := filepath.Join(dir, "good.yaml")
	_ = os.WriteFile(bad, []byte("entries:\n  - {name: A, type: aws, targets: []}\n"), 0o600)
	_ = os.WriteFile(good, []byte("entries:\n  - {name: k8s, type: kubernetes, targets: [proxies, more]}\n"), 0o600)
	cases := []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "--config is required"},
		{[]string{"--config", filepath.Join(dir, "missing.yaml")}, 2, "no such file"},
		{[]string{"--config", bad}, 2, "entries[0].type"},
		{[]string{"--config", good, "extra"}, 2, "unexpected argument"},
		{[]string{"--config", good, "--check-config"}, 0, "entry k8s (kubernetes): targets [proxies more]"},
	}
	for _, c := range cases {
		var out strings.Builder
		if code := agentcmd.Main(spec(), c.args, &out); code != c.code || !strings.Contains(out.String(), c.want) {
			t.Errorf("Main(%v) = %d %q, want %d and %q", c.args, code, out.String(), c.code, c.want)
		}
	}
}
