package cloudinit

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/testgate"
)

// TestOwnAddressesScriptFollowsChanges runs the guest's own-address script
// with this host's ip(8) and a systemctl that records its calls: the list
// holds loopback, every address of the host and the IPv6 forms carrying
// each IPv4 one; Squid is reloaded when the list changed (a stale list, as
// after an address change), not otherwise, and a failed reload is retried
// at the next run.
func TestOwnAddressesScriptFollowsChanges(t *testing.T) {
	testgate.NeedBinary(t, "ip", "install iproute2")
	sh := testgate.NeedBinary(t, "sh", "install a POSIX shell")
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	calls := filepath.Join(dir, "calls")
	failing := filepath.Join(dir, "fail-reload")
	fake := "#!/bin/sh\necho \"$*\" >> " + calls + "\n[ ! -e " + failing + " ]\n"
	if err := os.WriteFile(filepath.Join(bin, "systemctl"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "own-addresses.sh")
	if err := os.WriteFile(script, []byte(OwnAddressesScript), 0o755); err != nil {
		t.Fatal(err)
	}
	list := filepath.Join(dir, "own")
	run := func() error {
		cmd := exec.Command(sh, script, list)
		cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Logf("own-addresses.sh: %v\n%s", err, out)
		}
		return err
	}
	reloads := func() int {
		b, _ := os.ReadFile(calls)
		return strings.Count(string(b), "try-reload-or-restart squid.service\n")
	}

	if err := run(); err != nil {
		t.Fatal(err)
	}
	if n := reloads(); n != 1 {
		t.Fatalf("%d reloads after the first run, want 1", n)
	}
	b, err := os.ReadFile(list)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Fields(string(b))
	host, err := egress.HostAddrs()
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"127.0.0.1", "::1", "::127.0.0.1", "::ffff:0:127.0.0.1", "64:ff9b::127.0.0.1"}
	for _, a := range host {
		want = append(want, a.String())
		if a.Is4() {
			want = append(want, "::"+a.String(), "::ffff:0:"+a.String(), "64:ff9b::"+a.String())
		}
	}
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("the list lacks %s:\n%s", w, b)
		}
	}
	for _, g := range got {
		if _, err := netip.ParseAddr(g); err != nil {
			t.Errorf("the list holds %q, not an address", g)
		}
	}

	// Nothing changed: no reload.
	if err := run(); err != nil || reloads() != 1 {
		t.Fatalf("an unchanged list reloaded squid (%d reloads, %v)", reloads(), err)
	}
	// The list Squid loaded is stale (an address came or went since):
	// rewritten and reloaded, and a failed reload is retried at the next
	// run.
	for _, f := range []string{list, list + ".loaded"} {
		if err := os.WriteFile(f, []byte("127.0.0.1\n::1\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(failing, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(); err == nil {
		t.Fatal("the run whose reload failed succeeded")
	}
	if b2, _ := os.ReadFile(list); string(b2) != string(b) {
		t.Errorf("the stale list was not rewritten:\n%s", b2)
	}
	if err := os.Remove(failing); err != nil {
		t.Fatal(err)
	}
	if err := run(); err != nil || reloads() != 3 {
		t.Fatalf("the failed reload was not retried: %d reloads, %v", reloads(), err)
	}
	if err := run(); err != nil || reloads() != 3 {
		t.Fatalf("%d reloads after the retry, want 3 (%v)", reloads(), err)
	}
}
