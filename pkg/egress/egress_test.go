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
	got := p.SquidRules(SquidOwn{File: "/etc/squid/own", Host: "pod-1"})
	for _, want := range []string{
		"acl proxyfleet_ssl_ports port 443 8080\n",
		"acl proxyfleet_safe_ports port 80 443 8080\n",
		// An endpoint's port before its address: another port needs no lookup.
		"acl proxyfleet_endpoint_0 all-of proxyfleet_endpoint_0_port proxyfleet_endpoint_0_dst\n",
		"http_access deny !proxyfleet_endpoints proxyfleet_connect !proxyfleet_ssl_ports\n",
		"http_access deny !proxyfleet_endpoints !proxyfleet_safe_ports\n",
		"acl proxyfleet_allow_dst dst 10.1.0.0/16 ::a01:0/112 ::ffff:0:a01:0/112 64:ff9b::a01:0/112\n",
		"acl proxyfleet_egress_loopback dst 127.0.0.0/8 ::7f00:0/104 ::ffff:0:7f00:0/104 64:ff9b::7f00:0/104 ::1/128\n",
		// ::/128 is inside ::/104, 0.0.0.0/8 as IPv4-compatible.
		"acl proxyfleet_egress_unspecified dst 0.0.0.0/8 ::/104 ::ffff:0:0:0/104 64:ff9b::/104\n",
		"acl proxyfleet_egress_link_local dst 169.254.0.0/16 ::a9fe:0/112 ::ffff:0:a9fe:0/112 64:ff9b::a9fe:0/112 fe80::/10\n",
		// The host itself: no allowed range lifts it.
		"http_access deny !proxyfleet_endpoints proxyfleet_egress_loopback\n",
		"http_access deny !proxyfleet_endpoints proxyfleet_egress_unspecified\n",
		"http_access deny !proxyfleet_endpoints !proxyfleet_allow_dst proxyfleet_egress_private\n",
		"deny_info 403:ERR_PROXYFLEET_EGRESS_LOOPBACK proxyfleet_egress_loopback\n",
		"acl proxyfleet_egress_own_address dst \"/etc/squid/own\"\n",
		"acl proxyfleet_egress_own_address dst pod-1\n",
		"http_access deny !proxyfleet_endpoints proxyfleet_egress_own_address\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("SquidRules lacks %q:\n%s", want, got)
		}
	}
	for _, r := range Ranges {
		want := "http_access deny !proxyfleet_endpoints !proxyfleet_allow_dst " + squidACL(r.Rule) + "\n"
		if r.Always {
			want = "http_access deny !proxyfleet_endpoints " + squidACL(r.Rule) + "\n"
		}
		if !strings.Contains(got, want) {
			t.Errorf("no deny line %q for %s", want, r.Rule)
		}
	}
	// Squid keeps one of two overlapping entries of an acl, not always the
	// wider: no dst acl may hold overlapping prefixes.
	for _, l := range strings.Split(got, "\n") {
		f := strings.Fields(l)
		if len(f) < 4 || f[0] != "acl" || f[2] != "dst" || strings.HasPrefix(f[3], "\"") {
			continue
		}
		var ps []netip.Prefix
		for _, s := range f[3:] {
			pr, err := netip.ParsePrefix(s)
			if err != nil {
				if a, aerr := netip.ParseAddr(s); aerr == nil {
					pr = netip.PrefixFrom(a, a.BitLen())
				} else if s != "pod-1" {
					t.Fatalf("%s: %v", l, err)
				}
			}
			for _, q := range ps {
				if pr.IsValid() && q.Overlaps(pr) {
					t.Errorf("%s: %s and %s overlap", l, q, pr)
				}
			}
			ps = append(ps, pr)
		}
	}
	if strings.Contains(got, "http_access allow") {
		t.Errorf("the rules must only deny:\n%s", got)
	}
}

// TestHostItselfAlwaysRefused: no allowed range opens the host itself —
// loopback and unspecified, IPv4 and IPv6, and the IPv6 forms that carry
// them — even a range that holds every address; only an endpoint does.
func TestHostItselfAlwaysRefused(t *testing.T) {
	all := Policy{
		AllowCIDRs: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")},
		AllowPorts: []uint16{4222, 8480},
	}
	cases := []struct {
		addr string
		want Rule
	}{
		{"0.0.0.0", RuleUnspecified},
		{"0.1.2.3", RuleUnspecified},
		{"127.0.0.1", RuleLoopback},
		{"127.0.0.2", RuleLoopback},
		{"127.255.255.254", RuleLoopback},
		{"::", RuleUnspecified},
		{"::1", RuleLoopback},
		{"::ffff:127.0.0.1", RuleLoopback},
		{"::ffff:0.0.0.0", RuleUnspecified},
		{"64:ff9b::7f00:1", RuleLoopback},
		{"64:ff9b::", RuleUnspecified},
		{"::7f00:1", RuleLoopback},
		{"::127.0.0.2", RuleLoopback},
		{"::2", RuleUnspecified},
		{"::ffff:0:7f00:1", RuleLoopback},
		// The rest of what the ranges allow stays allowed.
		{"10.0.0.1", RuleOK},
		{"64:ff9b::a00:1", RuleOK},
		{"8.8.8.8", RuleOK},
		{"fd00::1", RuleOK},
	}
	for _, c := range cases {
		for _, connect := range []bool{true, false} {
			if got := all.Check(netip.MustParseAddr(c.addr), 4222, connect); got != c.want {
				t.Errorf("allowing 0.0.0.0/0 and ::/0: Check(%s, 4222, connect=%v) = %q, want %q", c.addr, connect, got, c.want)
			}
		}
	}
	// An endpoint still reaches the host: the echo endpoint on loopback.
	all.AllowEndpoints = []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:8480")}
	if got := all.Check(netip.MustParseAddr("127.0.0.1"), 8480, false); got != RuleOK {
		t.Errorf("the endpoint 127.0.0.1:8480 = %q, want allowed", got)
	}
	if got := all.Check(netip.MustParseAddr("127.0.0.1"), 4222, false); got != RuleLoopback {
		t.Errorf("127.0.0.1:4222 beside the endpoint = %q, want %q", got, RuleLoopback)
	}
}

// TestIPv4InIPv6: an IPv6 address that carries an IPv4 address (mapped,
// compatible, translated, NAT64) is checked as that IPv4 address, for the
// ranges, the allowances and the host's own addresses.
func TestIPv4InIPv6(t *testing.T) {
	def := Policy{Own: []netip.Addr{netip.MustParseAddr("203.0.114.7")}}
	allow := Policy{AllowCIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}}
	cases := []struct {
		pol  Policy
		addr string
		want Rule
	}{
		{def, "64:ff9b::a00:1", RulePrivate},
		{def, "64:ff9b::10.0.0.1", RulePrivate},
		{def, "64:ff9b::a9fe:a9fe", RuleLinkLocal},
		{def, "::a00:1", RulePrivate},
		{def, "::169.254.169.254", RuleLinkLocal},
		{def, "::ffff:0:a00:1", RulePrivate},
		{def, "::ffff:0:c0a8:101", RulePrivate},
		{def, "64:ff9b::e000:1", RuleMulticast},
		{def, "64:ff9b::cb00:7207", RuleOwnAddress},
		{def, "::203.0.114.7", RuleOwnAddress},
		{def, "64:ff9b::808:808", RuleOK},
		{def, "::808:808", RuleOK},
		{def, "::ffff:0:808:808", RuleOK},
		// Neighbours of the forms are plain IPv6 addresses.
		{def, "64:ff9b::1:a00:1", RuleOK},
		{allow, "64:ff9b::a01:5", RuleOK},
		{allow, "::a01:5", RuleOK},
		{allow, "64:ff9b::a02:5", RulePrivate},
	}
	for _, c := range cases {
		if got := c.pol.Check(netip.MustParseAddr(c.addr), 443, true); got != c.want {
			t.Errorf("%+v Check(%s) = %q, want %q", c.pol, c.addr, got, c.want)
		}
	}
}

// TestPortRuleNeedsNoAddress: the port rule a proxy asks before resolving
// refuses exactly the ports no destination may be reached on.
func TestPortRuleNeedsNoAddress(t *testing.T) {
	ep := Policy{AllowEndpoints: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:8480")}}
	cases := []struct {
		pol     Policy
		port    uint16
		connect bool
		want    Rule
	}{
		{Policy{}, 443, true, RuleOK},
		{Policy{}, 80, false, RuleOK},
		{Policy{}, 80, true, RulePort},
		{Policy{}, 22, true, RulePort},
		{Policy{}, 8080, false, RulePort},
		{Policy{AllowPorts: []uint16{8080}}, 8080, true, RuleOK},
		{ep, 8480, true, RuleOK},
		{ep, 8480, false, RuleOK},
		{ep, 8481, false, RulePort},
	}
	for _, c := range cases {
		if got := c.pol.PortRule(c.port, c.connect); got != c.want {
			t.Errorf("%+v PortRule(%d, connect=%v) = %q, want %q", c.pol, c.port, c.connect, got, c.want)
		}
	}
}

func TestCheckAllowCIDR(t *testing.T) {
	refused := []struct{ cidr, names string }{
		{"0.0.0.0/0", "127.0.0.0/8 (loopback)"},
		{"::/0", "::1/128 (loopback)"},
		{"0.0.0.0/1", "127.0.0.0/8 (loopback)"},
		{"127.0.0.0/8", "127.0.0.0/8 (loopback)"},
		{"127.0.0.2/32", "127.0.0.0/8 (loopback)"},
		{"0.0.0.0/32", "0.0.0.0/8 (unspecified)"},
		{"0.0.0.0/8", "0.0.0.0/8 (unspecified)"},
		{"::/128", "::/128 (unspecified)"},
		{"::1/128", "::1/128 (loopback)"},
		{"::/96", "::1/128 (loopback)"},
		{"::7f00:1/128", "::7f00:0/104 (loopback 127.0.0.0/8 in IPv6)"},
		{"64:ff9b::/96", "64:ff9b::7f00:0/104 (loopback 127.0.0.0/8 in IPv6)"},
		{"64:ff9b::7f00:1/128", "64:ff9b::7f00:0/104 (loopback 127.0.0.0/8 in IPv6)"},
		{"::ffff:0:0:0/96", "::ffff:0:7f00:0/104 (loopback 127.0.0.0/8 in IPv6)"},
		{"64:ff9b::/104", "64:ff9b::/104 (unspecified 0.0.0.0/8 in IPv6)"},
	}
	for _, c := range refused {
		err := CheckAllowCIDR(netip.MustParsePrefix(c.cidr))
		if err == nil || !strings.HasPrefix(err.Error(), "holds "+c.names+", which no allowance opens") {
			t.Errorf("CheckAllowCIDR(%s) = %v, want it refused naming %s", c.cidr, err, c.names)
		}
	}
	for _, ok := range []string{"10.0.0.0/8", "1.0.0.0/8", "128.0.0.0/1", "126.0.0.0/8", "fd12::/16", "2000::/3", "64:ff9b::a00:0/104", "64:ff9b:1::/48", "169.254.0.0/16"} {
		if err := CheckAllowCIDR(netip.MustParsePrefix(ok)); err != nil {
			t.Errorf("CheckAllowCIDR(%s) = %v, want accepted", ok, err)
		}
	}
}

// TestSquidHideClient: every client header is stripped, Via included
// (with "via off" alone Squid forwards the client's).
func TestSquidHideClient(t *testing.T) {
	got := SquidHideClient()
	for _, want := range []string{"via off\n", "forwarded_for delete\n", "request_header_access Forwarded deny all\n", "request_header_access Via deny all\n", "request_header_access X-Forwarded-For deny all\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("SquidHideClient lacks %q:\n%s", want, got)
		}
	}
}

// TestSquidRulesAllowingEverything: a recorded allowance of 0.0.0.0/0 and
// ::/0 still leaves the host's deny lines without the allowance's
// exception, and 0.0.0.0/0 is written as its two halves (Squid reads
// "0.0.0.0/0" as "all", IPv6 included).
func TestSquidRulesAllowingEverything(t *testing.T) {
	p, err := Compile([]string{"0.0.0.0/0", "::/0"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := p.SquidRules(SquidOwn{})
	for _, want := range []string{
		"acl proxyfleet_allow_dst dst 0.0.0.0/1 128.0.0.0/1 ::/0\n",
		"http_access deny proxyfleet_egress_loopback\n",
		"http_access deny proxyfleet_egress_unspecified\n",
		"http_access deny !proxyfleet_allow_dst proxyfleet_egress_private\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("SquidRules lacks %q:\n%s", want, got)
		}
	}
}
