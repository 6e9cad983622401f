package kube

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/squidtest"
	"proxyfleet/pkg/testgate"
)

// TestSquidConfParses runs Debian's `squid -k parse` on the Pod's
// squid.conf, with and without auth and a pool's allowance. It belongs to
// the squid tier (make test-squid sets PROXYFLEET_SQUID) and skips
// elsewhere.
func TestSquidConfParses(t *testing.T) {
	squid := squidtest.Binary(t)
	pol, err := (&events.Egress{AllowCIDRs: []string{"10.1.0.0/16"}, AllowPorts: []int{8080}}).Policy(
		[]netip.AddrPort{netip.MustParseAddrPort("10.96.0.20:8480")})
	if err != nil {
		t.Fatal(err)
	}
	// A Pod's name is its host name, which the kubelet's /etc/hosts maps
	// to its addresses; here this host's name stands for it.
	pod, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	for _, auth := range []*events.ProxyAuth{nil, {Username: "crawler", Password: "pw"}} {
		for _, p := range []egress.Policy{{}, pol} {
			conf := squidConf(pod, 3128, auth, "/usr/lib/squid/basic_ncsa_auth", p)
			if err := squidtest.ParseConf(squid, t.TempDir(), conf); err != nil {
				t.Errorf("auth %v, %d allowed ranges: %v\n%s", auth != nil, len(p.AllowCIDRs), err, conf)
			}
		}
	}
}

// TestSquidConfUnresolvablePodRefused: a Squid that cannot resolve the
// Pod's name, so cannot know its own addresses, refuses to start rather
// than run without the own-address rule.
func TestSquidConfUnresolvablePodRefused(t *testing.T) {
	squid := os.Getenv("PROXYFLEET_SQUID")
	if squid == "" {
		t.Skip("squid tier: set PROXYFLEET_SQUID to a squid binary (make test-squid)")
	}
	testgate.NeedFile(t, squid, "install Debian's squid (make squid-install)")
	conf := squidConf("px-nowhere.invalid", 3128, nil, "/x", egress.Policy{})
	path := filepath.Join(t.TempDir(), "squid.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(squid, "-k", "parse", "-f", path).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "px-nowhere.invalid") {
		t.Errorf("squid -k parse accepted an own-address acl it could not resolve: %v\n%s", err, out)
	}
}
