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
}

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// Ranges are the refused destination ranges, IPv4 and IPv6. An IPv4-mapped
// IPv6 address (::ffff:a.b.c.d) is checked as the IPv4 address it carries.
var Ranges = []Range{
	{RuleUnspecified, prefixes("0.0.0.0/8", "::/128")},
	{RuleLoopback, prefixes("127.0.0.0/8", "::1/128")},
	// 169.254.169.254 (and fd00:ec2::254, in the unique-local range) is the
	// cloud metadata service.
	{RuleLinkLocal, prefixes("169.254.0.0/16", "fe80::/10")},
	{RulePrivate, prefixes(
		"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
		"100.64.0.0/10",  // carrier-grade NAT shared space
		"192.0.0.0/24",   // IETF protocol assignments
		"198.18.0.0/15",  // benchmarking
		"64:ff9b:1::/48", // local-use NAT64
	)},
	{RuleUniqueLocal, prefixes("fc00::/7", "fec0::/10")},
	{RuleMulticast, prefixes("224.0.0.0/4", "ff00::/8")},
	{RuleReserved, prefixes(
		"240.0.0.0/4",                                                        // includes 255.255.255.255
		"192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32", // documentation
		"100::/64",  // discard-only
		"2001::/23", // IETF protocol assignments (Teredo, ORCHID...)
		"2002::/16", // 6to4: reaches any IPv4 address, private ones included
	)},
}

// Default ports.
const (
	ConnectPort = 443
	HTTPPort    = 80
)

// Policy is what one proxy may reach. The zero value is the default policy.
type Policy struct {
	// AllowCIDRs are destinations allowed despite [Ranges] (still subject to
	// the port rule, and never the host's own addresses).
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
// [RuleOK]. connect tells a CONNECT tunnel from a plain HTTP request.
func (p *Policy) Check(addr netip.Addr, port uint16, connect bool) Rule {
	addr = addr.Unmap().WithZone("")
	if slices.Contains(p.AllowEndpoints, netip.AddrPortFrom(addr, port)) {
		return RuleOK
	}
	if !p.portAllowed(port, connect) {
		return RulePort
	}
	// The ranges first (lifted by an allowed range), then the host's own
	// addresses, which an allowed range never opens: only an endpoint
	// reaches the host. Squid checks in the same order.
	allowed := slices.ContainsFunc(p.AllowCIDRs, func(pr netip.Prefix) bool { return pr.Contains(addr) })
	if r := rangeRule(addr); r != RuleOK && !allowed {
		return r
	}
	if slices.ContainsFunc(p.Own, func(o netip.Addr) bool { return o.Unmap().WithZone("") == addr }) {
		return RuleOwnAddress
	}
	return RuleOK
}

// rangeRule returns the rule of the refused range holding addr, or [RuleOK].
func rangeRule(addr netip.Addr) Rule {
	for _, r := range Ranges {
		for _, pr := range r.Prefixes {
			if pr.Contains(addr) {
				return r.Rule
			}
		}
	}
	return RuleOK
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

// ParsePort parses an allowed port, 1 to 65535.
func ParsePort(n int) (uint16, error) {
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("must be between 1 and 65535")
	}
	return uint16(n), nil
}

// Compile builds a policy from a pool's allowed CIDRs and ports (already
// validated by the pool spec) and the agent's allowed endpoints.
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

// SquidRules returns the squid.conf lines that enforce p: acls, http_access
// deny lines and their deny_info pages. They must come before any
// http_access allow line (authentication included). Squid evaluates dst acls
// on the resolved addresses of the request's host and connects to those
// same addresses. ownFile, when set, is a file of the host's own addresses
// (one a line) read as the own-address acl, for hosts whose addresses are
// only known at boot; p.Own is used as well.
func (p *Policy) SquidRules(ownFile string) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
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
			line("acl %s all-of %s_dst %s_port", n, n, n)
			names[i] = n
		}
		line("acl proxyfleet_endpoints any-of %s", strings.Join(names, " "))
		unless = "!proxyfleet_endpoints "
	}
	line("http_access deny %sproxyfleet_connect !proxyfleet_ssl_ports", unless)
	line("http_access deny %s!proxyfleet_safe_ports", unless)
	line("deny_info 403:%s proxyfleet_ssl_ports", SquidPage(RulePort))
	line("deny_info 403:%s proxyfleet_safe_ports", SquidPage(RulePort))
	unlessEndpoint := unless
	if len(p.AllowCIDRs) > 0 {
		cidrs := make([]string, len(p.AllowCIDRs))
		for i, c := range p.AllowCIDRs {
			cidrs[i] = c.String()
		}
		line("acl proxyfleet_allow_dst dst %s", strings.Join(cidrs, " "))
		unless += "!proxyfleet_allow_dst "
	}
	for _, r := range Ranges {
		ps := make([]string, len(r.Prefixes))
		for i, pr := range r.Prefixes {
			ps[i] = pr.String()
		}
		line("acl %s dst %s", squidACL(r.Rule), strings.Join(ps, " "))
		line("http_access deny %s%s", unless, squidACL(r.Rule))
		line("deny_info 403:%s %s", SquidPage(r.Rule), squidACL(r.Rule))
	}
	own := squidACL(RuleOwnAddress)
	if len(p.Own) > 0 || ownFile != "" {
		for _, a := range p.Own {
			line("acl %s dst %s", own, a.Unmap().WithZone(""))
		}
		if ownFile != "" {
			line("acl %s dst %q", own, ownFile)
		}
		line("http_access deny %s%s", unlessEndpoint, own)
		line("deny_info 403:%s %s", SquidPage(RuleOwnAddress), own)
	}
	return b.String()
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
