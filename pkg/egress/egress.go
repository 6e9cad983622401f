// Package egress is the destination policy every proxy proxyfleet runs
// enforces: no loopback, link-local (cloud metadata), private, unique-local,
// multicast, unspecified or reserved addresses, none of the host's own
// addresses, CONNECT only to port 443 and plain HTTP only to ports 80 and
// 443, unless the pool or the agent allows more. The built-in forward proxy
// asks [Policy.Check] about every resolved address before it dials that very
// address; the Squid renderers turn the same [Ranges] into dst acls (see
// [Policy.SquidRules]).
package egress

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Rule names a refusal; it is what a refused client reads in the
// X-Proxyfleet-Egress header ("denied loopback") and the Squid error page.
type Rule string

// The rules, in the order they are checked.
const (
	RuleOK          Rule = ""
	RulePort        Rule = "port"
	RuleUnspecified Rule = "unspecified"
	RuleLoopback    Rule = "loopback"
	RuleLinkLocal   Rule = "link-local"
	RulePrivate     Rule = "private"
	RuleUniqueLocal Rule = "unique-local"
	RuleMulticast   Rule = "multicast"
	RuleReserved    Rule = "reserved"
	RuleOwnAddress  Rule = "own-address"
)

// Header is the response header naming the rule of a refusal.
const Header = "X-Proxyfleet-Egress"

// Range is a set of prefixes one [Rule] refuses.
type Range struct {
	Rule     Rule
	Prefixes []netip.Prefix
	// Always marks the ranges that are the host itself (loopback, and the
	// unspecified addresses, which reach it too): no allowed range opens
	// them, and [CheckAllowCIDR] refuses a range that holds any of them.
	// Only an allowed endpoint (the agent's --egress-allow) reaches them.
	Always bool
}

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// Ranges are the refused destination ranges, IPv4 and IPv6, in the order
// they are checked. An IPv6 address that carries an IPv4 address (see
// [Embedded]) is checked as that IPv4 address. Loopback comes before
// unspecified: ::1 is loopback, though an IPv4-compatible reading would
// make it 0.0.0.1.
var Ranges = []Range{
	{Rule: RuleLoopback, Prefixes: prefixes("127.0.0.0/8", "::1/128"), Always: true},
	{Rule: RuleUnspecified, Prefixes: prefixes("0.0.0.0/8", "::/128"), Always: true},
	// 169.254.169.254 (and fd00:ec2::254, in the unique-local range) is the
	// cloud metadata service.
	{Rule: RuleLinkLocal, Prefixes: prefixes("169.254.0.0/16", "fe80::/10")},
	{Rule: RulePrivate, Prefixes: prefixes(
		"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
		"100.64.0.0/10",  // carrier-grade NAT shared space
		"192.0.0.0/24",   // IETF protocol assignments
		"198.18.0.0/15",  // benchmarking
		"64:ff9b:1::/48", // local-use NAT64
	)},
	{Rule: RuleUniqueLocal, Prefixes: prefixes("fc00::/7", "fec0::/10")},
	{Rule: RuleMulticast, Prefixes: prefixes("224.0.0.0/4", "ff00::/8")},
	{Rule: RuleReserved, Prefixes: prefixes(
		"240.0.0.0/4",                                                        // includes 255.255.255.255
		"192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32", // documentation
		"100::/64",  // discard-only
		"2001::/23", // IETF protocol assignments (Teredo, ORCHID...)
		"2002::/16", // 6to4: reaches any IPv4 address, private ones included
	)},
}

// V4InV6 are the IPv6 prefixes whose last 32 bits are an IPv4 address a
// connection may reach: IPv4-mapped (::ffff:a.b.c.d, which this host's own
// stack turns into IPv4), IPv4-compatible (::a.b.c.d, deprecated),
// IPv4-translated (::ffff:0:a.b.c.d, SIIT) and the well-known NAT64 prefix
// (64:ff9b::a.b.c.d, which a NAT64 gateway, possibly this host, turns into
// IPv4).
var V4InV6 = prefixes("::ffff:0:0/96", "::/96", "::ffff:0:0:0/96", "64:ff9b::/96")

// Embedded returns the IPv4 address a carries when a is in one of the
// [V4InV6] forms (an IPv4 address is returned as it is). :: and ::1 carry
// none: they are IPv6's own unspecified and loopback addresses.
func Embedded(a netip.Addr) (netip.Addr, bool) {
	a = a.WithZone("")
	if a.Is4() {
		return a, true
	}
	if a == netip.IPv6Unspecified() || a == netip.IPv6Loopback() {
		return netip.Addr{}, false
	}
	for _, pr := range V4InV6 {
		if pr.Contains(a) {
			b := a.As16()
			return netip.AddrFrom4([4]byte(b[12:])), true
		}
	}
	return netip.Addr{}, false
}

// embed returns v4 (an IPv4 prefix) inside the /96 IPv6 prefix in.
func embed(in, v4 netip.Prefix) netip.Prefix {
	b := in.Addr().As16()
	a4 := v4.Addr().As4()
	copy(b[12:], a4[:])
	return netip.PrefixFrom(netip.AddrFrom16(b), 96+v4.Bits())
}

// withEmbeddings returns ps with, for every IPv4 prefix, the same prefix in
// each [V4InV6] form but the mapped one (Squid and this package read a
// mapped address as IPv4 already), and without the prefixes another one
// holds: Squid keeps only one of two overlapping entries of an acl, and
// not always the wider.
func withEmbeddings(ps []netip.Prefix) []netip.Prefix {
	var all []netip.Prefix
	for _, pr := range ps {
		all = append(all, pr)
		if pr.Addr().Is4() {
			for _, in := range V4InV6[1:] {
				all = append(all, embed(in, pr))
			}
		}
	}
	return minimal(all)
}

// minimal drops from ps the duplicates and the prefixes another prefix of
// ps holds, keeping the order of the rest.
func minimal(ps []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for i, p := range ps {
		held := false
		for j, q := range ps {
			if i != j && q.Bits() <= p.Bits() && q.Contains(p.Addr()) && (q.Bits() < p.Bits() || j < i) {
				held = true
				break
			}
		}
		if !held {
			out = append(out, p)
		}
	}
	return out
}

// Default ports.
const (
	ConnectPort = 443
	HTTPPort    = 80
)

// Policy is what one proxy may reach. The zero value is the default policy.
type Policy struct {
	// AllowCIDRs are destinations allowed despite [Ranges] (still subject to
	// the port rule, and never the [Range.Always] ranges or the host's own
	// addresses).
	AllowCIDRs []netip.Prefix
	// AllowPorts are ports allowed for CONNECT and plain HTTP beside the
	// defaults.
	AllowPorts []uint16
	// AllowEndpoints are exact address:port pairs always allowed, CONNECT
	// and plain HTTP: the health echo endpoint the probes fetch.
	AllowEndpoints []netip.AddrPort
	// Own are the host's own addresses, refused as [RuleOwnAddress].
	Own []netip.Addr
}

// Check returns the rule that refuses a connection to addr:port, or
// [RuleOK]. connect tells a CONNECT tunnel from a plain HTTP request. An
// address that carries an IPv4 address ([Embedded]) is checked as that
// IPv4 address.
func (p *Policy) Check(addr netip.Addr, port uint16, connect bool) Rule {
	addr = addr.Unmap().WithZone("")
	if slices.Contains(p.AllowEndpoints, netip.AddrPortFrom(addr, port)) {
		return RuleOK
	}
	if !p.portAllowed(port, connect) {
		return RulePort
	}
	dst := addr
	if v4, ok := Embedded(addr); ok {
		dst = v4
	}
	// The ranges first (lifted by an allowed range, but for the host
	// itself), then the host's own addresses, which an allowed range never
	// opens: only an endpoint reaches the host. Squid checks in the same
	// order.
	allowed := slices.ContainsFunc(p.AllowCIDRs, func(pr netip.Prefix) bool { return pr.Contains(dst) || pr.Contains(addr) })
	if r := rangeOf(dst); r != nil && (r.Always || !allowed) {
		return r.Rule
	}
	if slices.ContainsFunc(p.Own, func(o netip.Addr) bool {
		o = o.Unmap().WithZone("")
		return o == addr || o == dst
	}) {
		return RuleOwnAddress
	}
	return RuleOK
}

// PortRule returns [RulePort] when no destination at all may be reached on
// port: neither an allowed port nor an allowed endpoint's. It needs no
// address, so a proxy asks it before resolving a name: a request to a
// refused port never causes a DNS lookup.
func (p *Policy) PortRule(port uint16, connect bool) Rule {
	if p.portAllowed(port, connect) || slices.ContainsFunc(p.AllowEndpoints, func(ep netip.AddrPort) bool { return ep.Port() == port }) {
		return RuleOK
	}
	return RulePort
}

// rangeOf returns the refused range holding addr, or nil.
func rangeOf(addr netip.Addr) *Range {
	for i, r := range Ranges {
		for _, pr := range r.Prefixes {
			if pr.Contains(addr) {
				return &Ranges[i]
			}
		}
	}
	return nil
}

func (p *Policy) portAllowed(port uint16, connect bool) bool {
	if port == ConnectPort || !connect && port == HTTPPort {
		return true
	}
	return slices.Contains(p.AllowPorts, port)
}

// ParseEndpoints parses "ip:port" endpoints (a literal IP: the check runs
// after name resolution, so a name would mean nothing here).
func ParseEndpoints(ss []string) ([]netip.AddrPort, error) {
	var out []netip.AddrPort
	for _, s := range ss {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		ap, err := netip.ParseAddrPort(s)
		if err != nil || ap.Port() == 0 {
			return nil, fmt.Errorf("egress endpoint %q: want a literal ip:port such as 127.0.0.1:8480 or [::1]:8480", s)
		}
		out = append(out, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
	}
	return out, nil
}

// ParseCIDR parses one allowed range: a prefix ("10.1.0.0/16") or a single
// address. The prefix must be canonical (no host bits set).
func ParseCIDR(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("must be an IP address or a CIDR such as 10.1.0.0/16")
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("must be a CIDR such as 10.1.0.0/16")
	}
	if p.Masked() != p {
		return netip.Prefix{}, fmt.Errorf("has host bits set; write %s", p.Masked())
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("is an IPv4-mapped IPv6 range; write the IPv4 range")
	}
	return p, nil
}

// CheckAllowCIDR refuses an allowed range that holds an address of a
// [Range.Always] range, in any form (IPv4, or IPv6 carrying it, see
// [V4InV6]): such a range would promise what the policy never grants.
// 0.0.0.0/0 and ::/0 are refused as well: public addresses need no
// allowance, so an allowance lists the refused ranges it opens.
func CheckAllowCIDR(pr netip.Prefix) error {
	const never = "which no allowance opens: the host itself is reached only through the agent's --egress-allow; list the refused ranges to open (public addresses need no allowance)"
	// The ranges as written first, so ::/0 names ::1 rather than a form
	// carrying 127.0.0.0/8.
	for _, r := range Ranges {
		for _, q := range r.Prefixes {
			if r.Always && pr.Overlaps(q) {
				return fmt.Errorf("holds %s (%s), %s", q, r.Rule, never)
			}
		}
	}
	for _, r := range Ranges {
		for _, q := range r.Prefixes {
			if !r.Always || !q.Addr().Is4() {
				continue
			}
			for _, in := range V4InV6 {
				if e := embed(in, q); pr.Overlaps(e) {
					return fmt.Errorf("holds %s (%s %s in IPv6), %s", e, r.Rule, q, never)
				}
			}
		}
	}
	return nil
}

// ParsePort parses an allowed port, 1 to 65535.
func ParsePort(n int) (uint16, error) {
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("must be between 1 and 65535")
	}
	return uint16(n), nil
}

// Compile builds a policy from a pool's allowed CIDRs and ports (already
// validated by the pool spec) and the agent's allowed endpoints. It does
// not ask [CheckAllowCIDR]: a range recorded before that check still
// compiles, and [Policy.Check] and [Policy.SquidRules] keep the
// [Range.Always] ranges refused whatever it holds.
func Compile(cidrs []string, ports []int, endpoints []netip.AddrPort) (Policy, error) {
	var p Policy
	for i, c := range cidrs {
		pr, err := ParseCIDR(c)
		if err != nil {
			return Policy{}, fmt.Errorf("egress.allowCIDRs[%d] %q: %w", i, c, err)
		}
		p.AllowCIDRs = append(p.AllowCIDRs, pr)
	}
	for i, n := range ports {
		port, err := ParsePort(n)
		if err != nil {
			return Policy{}, fmt.Errorf("egress.allowPorts[%d] %d: %w", i, n, err)
		}
		p.AllowPorts = append(p.AllowPorts, port)
	}
	p.AllowEndpoints = append(p.AllowEndpoints, endpoints...)
	return p, nil
}

// FormatEndpoints writes endpoints as "ip:port" strings, the form
// [ParseEndpoints] reads.
func FormatEndpoints(eps []netip.AddrPort) []string {
	out := make([]string, len(eps))
	for i, e := range eps {
		out[i] = e.String()
	}
	return out
}

// portList joins ports for a Squid port acl.
func portList(defaults []uint16, extra []uint16) string {
	all := append(slices.Clone(defaults), extra...)
	slices.Sort(all)
	all = slices.Compact(all)
	parts := make([]string, len(all))
	for i, p := range all {
		parts[i] = strconv.Itoa(int(p))
	}
	return strings.Join(parts, " ")
}

// SquidPage returns the deny_info page name of a refusal, which Squid sends
// in its X-Squid-Error header ("403:ERR_PROXYFLEET_EGRESS_LOOPBACK 0").
func SquidPage(r Rule) string {
	return "ERR_PROXYFLEET_EGRESS_" + strings.ToUpper(strings.ReplaceAll(string(r), "-", "_"))
}

// SquidPageBody is the text of the error page [SquidPage] names, for the
// renderers that can install it.
func SquidPageBody(r Rule) string {
	return "proxyfleet egress: denied " + string(r) + "\n"
}

// squidACL is the acl of a range rule.
func squidACL(r Rule) string {
	return "proxyfleet_egress_" + strings.ReplaceAll(string(r), "-", "_")
}

// SquidOwn tells [Policy.SquidRules] where Squid finds the host's own
// addresses beside [Policy.Own], for hosts whose addresses are known only
// where Squid runs.
type SquidOwn struct {
	// File is a file of addresses, one a line, read when Squid (re)reads
	// its configuration.
	File string
	// Host is a host name Squid resolves when it reads its configuration
	// (a Kubernetes Pod's own name, which the kubelet's /etc/hosts maps to
	// the Pod's addresses); Squid refuses to start when it does not
	// resolve.
	Host string
}

// SquidRules returns the squid.conf lines that enforce p: acls, http_access
// deny lines and their deny_info pages. They must come before any
// http_access allow line (authentication included). Squid evaluates dst acls
// on the resolved addresses of the request's host and connects to those
// same addresses; the port rules come first, and an endpoint's port is
// tested before its address, so a refused port is answered without a DNS
// lookup. Every range is
// listed with its IPv4-in-IPv6 forms ([V4InV6]), the [Range.Always] ranges
// are denied whatever p allows, and own adds the host's own addresses to
// p.Own.
func (p *Policy) SquidRules(own SquidOwn) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	join := func(ps []netip.Prefix) string {
		ss := make([]string, len(ps))
		for i, pr := range ps {
			ss[i] = pr.String()
			if pr.Bits() == 0 && pr.Addr().Is4() {
				// Squid reads "0.0.0.0/0" as "all", IPv6 included.
				ss[i] = "0.0.0.0/1 128.0.0.0/1"
			}
		}
		return strings.Join(ss, " ")
	}
	line("# egress policy (proxyfleet): refused destinations answer 403 naming the rule")
	line("acl proxyfleet_connect method CONNECT")
	line("acl proxyfleet_ssl_ports port %s", portList([]uint16{ConnectPort}, p.AllowPorts))
	line("acl proxyfleet_safe_ports port %s", portList([]uint16{HTTPPort, ConnectPort}, p.AllowPorts))
	unless := ""
	if len(p.AllowEndpoints) > 0 {
		names := make([]string, len(p.AllowEndpoints))
		for i, ep := range p.AllowEndpoints {
			n := fmt.Sprintf("proxyfleet_endpoint_%d", i)
			line("acl %s_dst dst %s", n, ep.Addr())
			line("acl %s_port port %d", n, ep.Port())
			// The port first: all-of stops at the first mismatch, so
			// another port never needs the dst acl's lookup.
			line("acl %s all-of %s_port %s_dst", n, n, n)
			names[i] = n
		}
		line("acl proxyfleet_endpoints any-of %s", strings.Join(names, " "))
		unless = "!proxyfleet_endpoints "
	}
	// The port acl last: deny_info answers with the page of the line's
	// last acl.
	line("http_access deny %sproxyfleet_connect !proxyfleet_ssl_ports", unless)
	line("http_access deny %s!proxyfleet_safe_ports", unless)
	line("deny_info 403:%s proxyfleet_ssl_ports", SquidPage(RulePort))
	line("deny_info 403:%s proxyfleet_safe_ports", SquidPage(RulePort))
	lift := unless
	if len(p.AllowCIDRs) > 0 {
		line("acl proxyfleet_allow_dst dst %s", join(withEmbeddings(p.AllowCIDRs)))
		lift += "!proxyfleet_allow_dst "
	}
	for _, r := range Ranges {
		line("acl %s dst %s", squidACL(r.Rule), join(withEmbeddings(r.Prefixes)))
		if r.Always {
			line("http_access deny %s%s", unless, squidACL(r.Rule))
		} else {
			line("http_access deny %s%s", lift, squidACL(r.Rule))
		}
		line("deny_info 403:%s %s", SquidPage(r.Rule), squidACL(r.Rule))
	}
	acl := squidACL(RuleOwnAddress)
	if len(p.Own) > 0 || own != (SquidOwn{}) {
		var addrs []netip.Prefix
		for _, a := range p.Own {
			a = a.Unmap().WithZone("")
			addrs = append(addrs, netip.PrefixFrom(a, a.BitLen()))
		}
		if len(addrs) > 0 {
			line("acl %s dst %s", acl, join(withEmbeddings(addrs)))
		}
		if own.File != "" {
			line("acl %s dst %q", acl, own.File)
		}
		if own.Host != "" {
			line("acl %s dst %s", acl, own.Host)
		}
		line("http_access deny %s%s", unless, acl)
		line("deny_info 403:%s %s", SquidPage(RuleOwnAddress), acl)
	}
	return b.String()
}

// ClientHeaders are the request headers that tell the origin about the
// client or the proxies before this one. No proxy proxyfleet runs forwards
// them, whoever set them: they would name the crawler behind the proxy,
// and an origin that trusts them could be told anything.
var ClientHeaders = []string{"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Via"}

// SquidHideClient returns the squid.conf lines that keep the client hidden:
// Squid adds no Via or X-Forwarded-For of its own and forwards none of the
// [ClientHeaders] a client sent (with "via off" alone, Squid forwards the
// client's Via as it came, and it never touches Forwarded).
func SquidHideClient() string {
	var b strings.Builder
	b.WriteString("via off\nforwarded_for delete\n")
	for _, h := range ClientHeaders {
		fmt.Fprintf(&b, "request_header_access %s deny all\n", h)
	}
	return b.String()
}

// squidForwardErrors are the Squid errors of a request Squid could not
// carry to the origin or back: the error pages a gateway may retry on
// another proxy.
var squidForwardErrors = []string{
	"ERR_CONNECT_FAIL", "ERR_DNS_FAIL", "ERR_READ_TIMEOUT", "ERR_LIFETIME_EXP",
	"ERR_READ_ERROR", "ERR_WRITE_ERROR", "ERR_ZERO_SIZE_OBJECT", "ERR_INVALID_RESP",
	"ERR_GATEWAY_FAILURE", "ERR_CANNOT_FORWARD", "ERR_SOCKET_FAILURE", "ERR_SHUTTING_DOWN",
}

// SquidMarkOwnErrors returns the squid.conf lines that make
// X-Proxyfleet-Proxy-Error (events.ProxyErrorHeader) a marker only Squid
// sets: it is removed from every reply, the origin's included, and added
// ("squid ERR_CONNECT_FAIL") to the error pages Squid makes when it could
// not carry a request. Squid's own X-Squid-Error cannot serve: an
// origin's copy passes through, and reply_header_access would strip it
// from Squid's pages as well, which it applies to them too.
func SquidMarkOwnErrors() string {
	return "acl proxyfleet_forward_error squid_error " + strings.Join(squidForwardErrors, " ") + "\n" +
		"reply_header_access X-Proxyfleet-Proxy-Error deny all\n" +
		"reply_header_add X-Proxyfleet-Proxy-Error \"squid %err_code\" proxyfleet_forward_error\n"
}

// HostAddrs lists the addresses of every interface of this host, the
// [Policy.Own] of a proxy running here.
func HostAddrs() ([]netip.Addr, error) {
	ifas, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(ifas))
	for _, ifa := range ifas {
		if n, ok := ifa.(*net.IPNet); ok {
			if a, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, a.Unmap())
			}
		}
	}
	return out, nil
}
