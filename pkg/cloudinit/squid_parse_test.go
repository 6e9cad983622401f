package cloudinit

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/squidtest"
)

// TestSquidDefaultConfParses runs Debian's `squid -k parse` on the
// squid.conf of the default cloud-config, with and without auth and a
// pool's allowance. It belongs to the squid tier (make test-squid sets
// PROXYFLEET_SQUID) and skips elsewhere.
func TestSquidDefaultConfParses(t *testing.T) {
	squid := squidtest.Binary(t)
	pol, err := (&events.Egress{AllowCIDRs: []string{"10.1.0.0/16", "2001:db8:1::/48"}, AllowPorts: []int{8080, 8443}}).Policy(
		[]netip.AddrPort{netip.MustParseAddrPort("203.0.114.9:8480"), netip.MustParseAddrPort("[2a00:1450::9]:8480")})
	if err != nil {
		t.Fatal(err)
	}
	for _, auth := range []*events.ProxyAuth{nil, {Username: "crawler", Password: "pw"}} {
		for _, p := range []egress.Policy{{}, pol} {
			doc, err := DefaultSquidUserData(3128, auth, p)
			if err != nil {
				t.Fatal(err)
			}
			var cc struct {
				WriteFiles []struct {
					Path    string `yaml:"path"`
					Content string `yaml:"content"`
				} `yaml:"write_files"`
			}
			if err := yaml.Unmarshal(doc, &cc); err != nil {
				t.Fatal(err)
			}
			var conf string
			for _, f := range cc.WriteFiles {
				if f.Path == "/etc/proxyfleet/squid.conf" {
					conf = f.Content
				}
			}
			dir := t.TempDir()
			// The guest lists its own addresses at boot; here a file with
			// what the script writes first, each IPv4 address in its IPv6
			// forms too.
			own := filepath.Join(dir, "own")
			if err := os.WriteFile(own, []byte("127.0.0.1\n64:ff9b::127.0.0.1\n::127.0.0.1\n::1\n::ffff:0:127.0.0.1\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			conf = strings.ReplaceAll(conf, OwnAddressesFile, own)
			if err := squidtest.ParseConf(squid, dir, conf); err != nil {
				t.Errorf("auth %v, %d allowed ranges: %v\n%s", auth != nil, len(p.AllowCIDRs), err, conf)
			}
		}
	}
}
