package kube

import (
	"net/netip"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/squidtest"
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
	for _, auth := range []*events.ProxyAuth{nil, {Username: "crawler", Password: "pw"}} {
		for _, p := range []egress.Policy{{}, pol} {
			conf := squidConf(3128, auth, "/usr/lib/squid/basic_ncsa_auth", p)
			if err := squidtest.ParseConf(squid, t.TempDir(), conf); err != nil {
				t.Errorf("auth %v, %d allowed ranges: %v\n%s", auth != nil, len(p.AllowCIDRs), err, conf)
			}
		}
	}
}
