package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/agentcmd"
)

// TestRunExitCodesAndOutput runs the command line as main does: --help,
// configuration errors (exit 2, every problem named by its key) and
// --check-config.
func TestRunExitCodesAndOutput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(bad, []byte("entry: kvm-home\ntarget: h\npool: default\nnetwork: default\nvlna: 4\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	doc := `entry: kvm-home
target: h
pool: default
network: default
images: {debian-12: {url: "https://images.example/debian-12.qcow2"}}
profiles: {small: {vcpus: 1, memoryMiB: 512, diskGiB: 4}}
`
	if err := os.WriteFile(good, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		args []string
		code int
		want []string
	}{
		{[]string{"--help"}, 0, []string{"Usage: kvm-agent [flags]", "docs/kvm.md", "-config", "-check-config", "-recheck-interval", "-log-libvirt-xml", "-nats-url"}},
		{[]string{"--config", filepath.Join(dir, "missing.yaml")}, 2, []string{"kvm-agent: open ", "no such file"}},
		{[]string{"--config", bad}, 2, []string{"kvm-agent: invalid config " + bad + ":\n", "\n  vlna: unknown key", "\n  images: at least one image is required"}},
		{[]string{"--config", good, "extra"}, 2, []string{"unexpected argument"}},
		{[]string{"--config", good, "--check-config"}, 0, []string{"kvm-agent: " + good + " is valid"}},
	}
	for _, c := range cases {
		var out strings.Builder
		code := agentcmd.Main(spec(), c.args, &out)
		if code != c.code {
			t.Errorf("Main(%q) = %d, want %d; output:\n%s", c.args, code, c.code, &out)
		}
		for _, w := range c.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("Main(%q) output lacks %q:\n%s", c.args, w, &out)
			}
		}
	}
}
