package egress

import (
	"net/netip"
	"strings"
	"testing"
)

func TestCheckRanges(t *testing.T) {
	own := netip.MustParseAddr("203.0.114.7")
	p := Policy{Own: []netip.Addr{own, netip.MustParseAddr("2a00:1450::7")}}
	cases := []struct {
		addr string
		want Rule
	}{
		{"0.0.0.0", RuleUnspecified},
		{"::", RuleUnspecified},
		{"127.0.0.1", RuleLoopback},
		{"127.255.0.9", RuleLoopback},
		{"::1", RuleLoopback},
		{"::ffff:127.0.0.1", RuleLoopback},
		{"169.254.169.254", RuleLinkLocal},
		{"::ffff:169.254.169.254", RuleLinkLocal},
		{"fe80::1", RuleLinkLocal},
		{"fd00:ec2::254", RuleUniqueLocal},
		{"fc00::1", RuleUniqueLocal},
		{"10.0.0.1", RulePrivate},
		{"10.255.255.255", RulePrivate},
		{"172.16.0.1", RulePrivate},
		{"172.31.255.1", RulePrivate},
		{"192.168.1.1", RulePrivate},
		{"::ffff:192.168.1.1", RulePrivate},
		{"100.64.0.1", RulePrivate},
		{"100.127.255.254", RulePrivate},
		{"198.18.0.1", RulePrivate},
		{"224.0.0.1", RuleMulticast},
		{"239.255.255.250", RuleMulticast},
		{"ff02::1", RuleMulticast},
		{"255.255.255.255", RuleReserved},
		{"240.0.0.1", RuleReserved},
		{"2002:7f00:1::", RuleReserved},
		{"203.0.114.7", RuleOwnAddress},
		{"::ffff:203.0.114.7", RuleOwnAddress},
		{"2a00:1450::7", RuleOwnAddress},
		// Public addresses, and neighbours just outside the ranges.
		{"8.8.8.8", RuleOK},
		{"172.32.0.1", RuleOK},
		{"172.15.255.255", RuleOK},
		{"100.128.0.1", RuleOK},
		{"11.0.0.1", RuleOK},
		{"169.255.0.1", RuleOK},
		{"2a00:1450::8", RuleOK},
		{"::ffff:8.8.8.8", RuleOK},
	}
	for _, c := range cases {
		for _, connect := range []bool{true, false} {
			if got := p.Check(netip.MustParseAddr(c.addr), 443, connect); got != c.want {
				t.Errorf("Check(%s, 443, connect=%v) = %q, want %q", c.addr, connect, got, c.want)
			}
		}
	}
}

func TestCheckPorts(t *testing.T) {
	pub := netip.MustParseAddr("8.8.8.8")
	cases := []struct {
		pol     Policy
		port    uint16
		connect bool
		want    Rule
	}{
		{Policy{}, 443, true, RuleOK},
		{Policy{}, 80, true, RulePort},
		{Policy{}, 22, true, RulePort},
		{Policy{}, 4222, true, RulePort},
		{Policy{}, 80, false, RuleOK},
		{Policy{}, 443, false, RuleOK},
		{Policy{}, 8080, false, RulePort},
		{Policy{AllowPorts: []uint16{8080}}, 8080, false, RuleOK},
		{Policy{AllowPorts: []uint16{8080}}, 8080, true, RuleOK},
		{Policy{AllowPorts: []uint16{8080}}, 8081, true, RulePort},
	}
	for _, c := range cases {
		if got := c.pol.Check(pub, c.port, c.connect); got != c.want {
			t.Errorf("%+v Check(%s, %d, connect=%v) = %q, want %q", c.pol, pub, c.port, c.connect, got, c.want)
		}
	}
	// A refused range answers for the port first: a port rule names the
	// port even on a loopback address.
	if got := (&Policy{}).Check(netip.MustParseAddr("127.0.0.1"), 4222, true); got != RulePort {
		t.Errorf("CONNECT 127.0.0.1:4222 = %q, want %q", got, RulePort)
	}
}

func TestAllowances(t *testing.T) {
	ep := netip.MustParseAddrPort("127.0.0.1:8480")
	p, err := Compile([]string{"10.1.0.0/16", "fd12::/16"}, []int{8080}, []netip.AddrPort{ep})
	if err != nil {
		t.Fatal(err)
	}
	p.Own = []netip.Addr{netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("127.0.0.1")}
	cases := []struct {
		addr    string
		port    uint16
		connect bool
		want    Rule
	}{
		{"127.0.0.1", 8480, true, RuleOK},
		{"127.0.0.1", 8480, false, RuleOK},
		{"::ffff:127.0.0.1", 8480, true, RuleOK},
		{"127.0.0.1", 8481, false, RulePort},
		{"127.0.0.1", 443, true, RuleLoopback},
		{"127.0.0.2", 8480, false, RulePort},
		{"10.1.2.3", 443, true, RuleOK},
		{"10.1.2.3", 8080, false, RuleOK},
		{"10.1.2.3", 22, true, RulePort},
		{"10.2.0.1", 443, true, RulePrivate},
		{"fd12::1", 443, true, RuleOK},
		{"fd13::1", 443, true, RuleUniqueLocal},
		// An allowed range never opens the host's own address.
		{"10.1.0.5", 443, true, RuleOwnAddress},
		{"127.0.0.1", 443, true, RuleLoopback},
		{"127.0.0.1", 8480, false, RuleOK},
	}
	for _, c := range cases {
		if got := p.Check(netip.MustParseAddr(c.addr), c.port, c.connect); got != c.want {
			t.Errorf("Check(%s, %d, connect=%v) = %q, want %q", c.addr, c.port, c.connect, got, c.want)
		}
	}
}

func TestParse(t *testing.T) {
	for _, bad := range []string{"10.1.0.1/16", "nope", "::ffff:10.0.0.0/104", "10.0.0.0/33", "fe80::1%eth0"} {
		if _, err := ParseCIDR(bad); err == nil {
			t.Errorf("ParseCIDR(%q) accepted", bad)
		}
	}
	if p, err := ParseCIDR("10.1.2.3"); err != nil || p.String() != "10.1.2.3/32" {
		t.Errorf("ParseCIDR(10.1.2.3) = %v, %v", p, err)
	}
	for _, bad := range [][]string{{"localhost:8480"}, {"127.0.0.1"}, {"127.0.0.1:0"}} {
		if _, err := ParseEndpoints(bad); err == nil {
			t.Errorf("ParseEndpoints(%q) accepted", bad)
		}
	}
	eps, err := ParseEndpoints([]string{"127.0.0.1:8480", " [::1]:9 ", ""})
	if err != nil || len(eps) != 2 || eps[1].String() != "[::1]:9" {
		t.Errorf("ParseEndpoints = %v, %v", eps, err)
	}
	if _, err := Compile(nil, []int{0}, nil); err == nil || !strings.HasPrefix(err.Error(), "egress.allowPorts[0]") {
		t.Errorf("Compile port 0: %v", err)
	}
}

func TestSquidRules(t *testing.T) {
	p, err := Compile([]string{"10.1.0.0/16"}, []int{8080}, []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:8480")})
	if err != nil {
		t.Fatal(err)
	}
	got := p.SquidRules("/etc/squid/own")
	for _, want := range []string{
		"acl proxyfleet_ssl_ports port 443 8080\n",
		"acl proxyfleet_safe_ports port 80 443 8080\n",
		"acl proxyfleet_endpoint_0 all-of proxyfleet_endpoint_0_dst proxyfleet_endpoint_0_port\n",
		"http_access deny !proxyfleet_endpoints proxyfleet_connect !proxyfleet_ssl_ports\n",
		"acl proxyfleet_allow_dst dst 10.1.0.0/16\n",
		"acl proxyfleet_egress_link_local dst 169.254.0.0/16 fe80::/10\n",
		"http_access deny !proxyfleet_endpoints !proxyfleet_allow_dst proxyfleet_egress_loopback\n",
		"deny_info 403:ERR_PROXYFLEET_EGRESS_LOOPBACK proxyfleet_egress_loopback\n",
		"acl proxyfleet_egress_own_address dst \"/etc/squid/own\"\n",
		"http_access deny !proxyfleet_endpoints proxyfleet_egress_own_address\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("SquidRules lacks %q:\n%s", want, got)
		}
	}
	for _, r := range Ranges {
		if !strings.Contains(got, "http_access deny !proxyfleet_endpoints !proxyfleet_allow_dst "+squidACL(r.Rule)+"\n") {
			t.Errorf("no deny line for %s", r.Rule)
		}
	}
	if strings.Contains(got, "http_access allow") {
		t.Errorf("the rules must only deny:\n%s", got)
	}
}
