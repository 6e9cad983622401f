package kube

import (
	"net/netip"
	"strings"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

func TestSquidConf(t *testing.T) {
	auth := &events.ProxyAuth{Username: "crawler", Password: "s3cret-canary"}
	conf := squidConf("px-abc", 8080, auth, "/usr/lib/squid/basic_ncsa_auth", egress.Policy{})
	for _, want := range []string{"http_port 8080\n", "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/proxyfleet/htpasswd\n", "http_access deny all\n", "pinger_enable off\n"} {
		if !strings.Contains(conf, want) {
			t.Errorf("squid.conf lacks %q:\n%s", want, conf)
		}
	}
	if strings.Contains(conf, "s3cret") {
		t.Errorf("the config holds the password:\n%s", conf)
	}
	if open := squidConf("px-abc", 3128, nil, "/x", egress.Policy{}); strings.Contains(open, "auth_param") || !strings.Contains(open, "http_access allow all") {
		t.Errorf("config without auth:\n%s", open)
	}
}

// TestSquidConfEgress: the pool's allowance and the agent's endpoints are
// in the config, and every egress deny comes before the first allow (auth
// or open), so it holds for every client.
func TestSquidConfEgress(t *testing.T) {
	pol, err := (&events.Egress{AllowCIDRs: []string{"10.1.0.0/16"}, AllowPorts: []int{8080}}).Policy([]netip.AddrPort{netip.MustParseAddrPort("10.0.0.9:8480")})
	if err != nil {
		t.Fatal(err)
	}
	for _, auth := range []*events.ProxyAuth{nil, {Username: "u", Password: "p"}} {
		conf := squidConf("px-abc", 3128, auth, "/x", pol)
		rules := pol.SquidRules(egress.SquidOwn{Host: "px-abc"})
		at, allow := strings.Index(conf, rules), strings.Index(conf, "http_access allow")
		if at < 0 || allow < at {
			t.Errorf("auth %v: the egress rules are missing or follow an allow:\n%s", auth != nil, conf)
		}
		for _, want := range []string{"acl proxyfleet_allow_dst dst 10.1.0.0/16 ::a01:0/112 ::ffff:0:a01:0/112 64:ff9b::a01:0/112\n", "acl proxyfleet_ssl_ports port 443 8080\n", "acl proxyfleet_endpoint_0_dst dst 10.0.0.9\n"} {
			if !strings.Contains(conf, want) {
				t.Errorf("config lacks %q", want)
			}
		}
	}
}

// TestSquidConfOwnAddressesAndClient: the own-address acl holds the Pod's
// name, which Squid resolves to the Pod's addresses (the kubelet's
// /etc/hosts), and is denied before any allow whatever the pool allows;
// the client's Forwarded, Via and X-Forwarded-* are not forwarded.
func TestSquidConfOwnAddressesAndClient(t *testing.T) {
	pol, err := (&events.Egress{AllowCIDRs: []string{"10.0.0.0/8"}}).Policy(nil)
	if err != nil {
		t.Fatal(err)
	}
	conf := squidConf("px-abc", 3128, nil, "/x", pol)
	own := strings.Index(conf, "acl proxyfleet_egress_own_address dst px-abc\n")
	deny := strings.Index(conf, "http_access deny proxyfleet_egress_own_address\n")
	if own < 0 || deny < own || deny > strings.Index(conf, "http_access allow") {
		t.Errorf("the Pod's own addresses are not denied before the allow:\n%s", conf)
	}
	for _, h := range egress.ClientHeaders {
		if !strings.Contains(conf, "request_header_access "+h+" deny all\n") {
			t.Errorf("squid.conf forwards the client's %s:\n%s", h, conf)
		}
	}
}
