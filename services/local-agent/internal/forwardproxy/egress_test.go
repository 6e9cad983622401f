package forwardproxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/testnet"
)

// watched is a loopback listener the test owns; it counts the connections
// it accepts and greets each as a NATS server would.
func watched(t *testing.T) *testnet.Counter {
	t.Helper()
	return testnet.Count(t, "127.0.0.1:0", "INFO {\"server_id\":\"test\"}\r\n")
}

// failingDial fails the test if the proxy ever dials: the policy must
// refuse before any packet is sent.
func failingDial(t *testing.T) func(context.Context, string, string) (net.Conn, error) {
	return func(_ context.Context, _, address string) (net.Conn, error) {
		t.Errorf("the proxy dialed %s; the egress policy must refuse it first", address)
		return nil, errors.New("dial forbidden by the test")
	}
}

// rawRequest sends one request line (CONNECT or an absolute-URI GET) and
// returns the response and how long it took.
func rawRequest(t *testing.T, proxy *url.URL, method, target string) (*http.Response, string, time.Duration) {
	t.Helper()
	c, err := net.Dial("tcp", proxy.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	host := target
	if u, err := url.Parse(target); err == nil && u.Host != "" {
		host = u.Host
	}
	start := time.Now()
	if _, err := io.WriteString(c, method+" "+target+" HTTP/1.1\r\nHost: "+host+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s: read response: %v", method, target, err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	return resp, string(body), time.Since(start)
}

func wantDenied(t *testing.T, resp *http.Response, body string, took time.Duration, rule egress.Rule) {
	t.Helper()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("status %d (%s), want 403", resp.StatusCode, body)
	}
	if got, want := resp.Header.Get(egress.Header), "denied "+string(rule); got != want {
		t.Errorf("%s: %q, want %q", egress.Header, got, want)
	}
	if !strings.Contains(body, "denied "+string(rule)) {
		t.Errorf("body %q does not name the rule %s", body, rule)
	}
	if took > 2*time.Second {
		t.Errorf("the refusal took %v; it must be at once", took)
	}
}

// TestConnectToLoopbackRefused: CONNECT to a port this test listens on (as
// NATS would on 4222) is refused at once and the listener never sees a
// connection; so is CONNECT to the same listener on port 443's rule
// (loopback), without dialing.
func TestConnectToLoopbackRefused(t *testing.T) {
	ln := watched(t)
	proxy := startProxy(t, Config{})
	resp, body, took := rawRequest(t, proxy, http.MethodConnect, ln.Addr().String())
	wantDenied(t, resp, body, took, egress.RulePort)
	// With its port allowed, the address itself is refused.
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	n, _ := strconv.Atoi(port)
	proxy = startProxy(t, Config{Egress: egress.Policy{AllowPorts: []uint16{uint16(n)}}})
	for _, target := range []string{ln.Addr().String(), "[::ffff:127.0.0.1]:" + port, "localhost:" + port} {
		resp, body, took = rawRequest(t, proxy, http.MethodConnect, target)
		wantDenied(t, resp, body, took, egress.RuleLoopback)
		resp, body, took = rawRequest(t, proxy, http.MethodGet, "http://"+target+"/")
		wantDenied(t, resp, body, took, egress.RuleLoopback)
	}
	if got := ln.Accepted(); got != 0 {
		t.Fatalf("the listener accepted %d connections through the proxy; want none", got)
	}
}

// TestOwnAddressRefused: a GET to a server on this host's own non-loopback
// address is refused.
func TestOwnAddressRefused(t *testing.T) {
	addrs, err := egress.HostAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var own netip.Addr
	for _, a := range addrs {
		if a.Is4() && !a.IsLoopback() && !a.IsLinkLocalUnicast() {
			own = a
			break
		}
	}
	if !own.IsValid() {
		t.Skip("this host has no non-loopback IPv4 address")
	}
	ln := testnet.Count(t, netip.AddrPortFrom(own, 0).String(), "")
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	// Its port and range are allowed: only the own-address rule refuses it,
	// which an allowed range never lifts.
	want := egress.RuleOwnAddress
	pol := egress.Policy{AllowPorts: []uint16{port}, AllowCIDRs: []netip.Prefix{netip.PrefixFrom(own, own.BitLen())}}
	proxy := startProxy(t, Config{Egress: pol})
	resp, body, took := rawRequest(t, proxy, http.MethodGet, "http://"+ln.Addr().String()+"/")
	wantDenied(t, resp, body, took, want)
	resp, body, took = rawRequest(t, proxy, http.MethodConnect, ln.Addr().String())
	wantDenied(t, resp, body, took, want)
	if got := ln.Accepted(); got != 0 {
		t.Fatalf("the listener on %s accepted %d connections through the proxy; want none", ln.Addr(), got)
	}
}

// TestMetadataAndPrivateRefusedWithoutDialing proves the link-local,
// metadata, private and unique-local rules with a dialer that fails the
// test if ever called: no packet can leave the machine.
func TestMetadataAndPrivateRefusedWithoutDialing(t *testing.T) {
	names := map[string][]netip.Addr{
		"metadata.test":  {netip.MustParseAddr("169.254.169.254")},
		"mixed.test":     {netip.MustParseAddr("93.184.215.14"), netip.MustParseAddr("10.0.0.7")},
		"metadata6.test": {netip.MustParseAddr("fd00:ec2::254")},
	}
	resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
		if a, ok := names[host]; ok {
			return a, nil
		}
		t.Errorf("unexpected lookup of %s", host)
		return nil, errors.New("no such host")
	}
	proxy := startProxy(t, Config{Dial: failingDial(t), Resolve: resolve, OwnAddrs: func() ([]netip.Addr, error) { return nil, nil }})
	cases := []struct {
		method, target string
		rule           egress.Rule
	}{
		{http.MethodGet, "http://169.254.169.254/latest/meta-data/", egress.RuleLinkLocal},
		{http.MethodConnect, "169.254.169.254:443", egress.RuleLinkLocal},
		{http.MethodGet, "http://metadata.test/computeMetadata/v1/", egress.RuleLinkLocal},
		{http.MethodConnect, "metadata.test:443", egress.RuleLinkLocal},
		{http.MethodGet, "http://[fd00:ec2::254]/latest/", egress.RuleUniqueLocal},
		{http.MethodConnect, "metadata6.test:443", egress.RuleUniqueLocal},
		{http.MethodGet, "http://[fe80::1]/", egress.RuleLinkLocal},
		{http.MethodConnect, "10.1.2.3:443", egress.RulePrivate},
		{http.MethodConnect, "172.16.5.4:443", egress.RulePrivate},
		{http.MethodGet, "http://192.168.1.1/", egress.RulePrivate},
		{http.MethodGet, "http://100.64.0.1/", egress.RulePrivate},
		{http.MethodConnect, "[::ffff:10.0.0.1]:443", egress.RulePrivate},
		{http.MethodConnect, "mixed.test:443", egress.RulePrivate},
		{http.MethodGet, "http://224.0.0.1/", egress.RuleMulticast},
		{http.MethodConnect, "0.0.0.0:443", egress.RuleUnspecified},
		{http.MethodConnect, "93.184.215.14:22", egress.RulePort},
		{http.MethodConnect, "93.184.215.14:80", egress.RulePort},
		{http.MethodGet, "http://93.184.215.14:8080/", egress.RulePort},
	}
	for _, c := range cases {
		resp, body, took := rawRequest(t, proxy, c.method, c.target)
		t.Run(c.method+" "+c.target, func(t *testing.T) { wantDenied(t, resp, body, took, c.rule) })
	}
}

// TestDialsTheCheckedAddress: the name is resolved once and the proxy dials
// the address it checked, as a literal, so a second answer cannot swap it
// (DNS rebinding).
func TestDialsTheCheckedAddress(t *testing.T) {
	origin := echoOrigin(t)
	ap := netip.MustParseAddrPort(strings.TrimPrefix(origin.URL, "http://"))
	var lookups atomic.Int32
	resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
		if lookups.Add(1) == 1 {
			return []netip.Addr{ap.Addr()}, nil
		}
		return []netip.Addr{netip.MustParseAddr("169.254.169.254")}, nil
	}
	var dialed []string
	dial := func(ctx context.Context, network, address string) (net.Conn, error) {
		dialed = append(dialed, address)
		var d net.Dialer
		return d.DialContext(ctx, network, address)
	}
	proxy := startProxy(t, Config{Resolve: resolve, Dial: dial, Egress: egress.Policy{AllowEndpoints: []netip.AddrPort{ap}}})
	resp, body, _ := rawRequest(t, proxy, http.MethodGet, "http://echo.test:"+strconv.Itoa(int(ap.Port()))+"/x")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d (%s), want 200 from the allowed endpoint", resp.StatusCode, body)
	}
	if len(dialed) != 1 || dialed[0] != ap.String() {
		t.Fatalf("dialed %v, want exactly [%s]", dialed, ap)
	}
	if n := lookups.Load(); n != 1 {
		t.Fatalf("%d lookups, want 1", n)
	}
}

// TestEchoEndpointAllowed: the probes' echo endpoint on loopback is reached
// by GET and CONNECT, while another port of the same address is refused.
func TestEchoEndpointAllowed(t *testing.T) {
	echo := echoOrigin(t)
	ap := netip.MustParseAddrPort(strings.TrimPrefix(echo.URL, "http://"))
	proxy := startProxy(t, Config{Egress: egress.Policy{AllowEndpoints: []netip.AddrPort{ap}}})
	resp, body, _ := rawRequest(t, proxy, http.MethodGet, echo.URL+"/")
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(body, "GET /") {
		t.Fatalf("GET the echo endpoint: %d %q, want 200", resp.StatusCode, body)
	}
	if got := rawConnect(t, proxy, ap.String(), ""); got != http.StatusOK {
		t.Fatalf("CONNECT the echo endpoint: %d, want 200", got)
	}
	other := watched(t)
	resp, body, took := rawRequest(t, proxy, http.MethodConnect, other.Addr().String())
	wantDenied(t, resp, body, took, egress.RulePort)
	if other.Accepted() != 0 {
		t.Fatal("another loopback port was reached")
	}
}

// TestHostItselfRefusedWhateverTheAllowance: a pool allowing every range
// (0.0.0.0/0 and ::/0, as recorded before validation refused them) and the
// listeners' ports still cannot reach this host: CONNECT 0.0.0.0:P (which
// the kernel delivers to a loopback listener), a GET to 127.0.0.2 (loopback,
// though no interface has that exact address) and the IPv6 forms carrying
// them are refused at once, and the listeners see no connection.
func TestHostItselfRefusedWhateverTheAllowance(t *testing.T) {
	loop := watched(t)
	loop2 := testnet.Count(t, "127.0.0.2:0", "")
	_, p1, _ := net.SplitHostPort(loop.Addr().String())
	_, p2, _ := net.SplitHostPort(loop2.Addr().String())
	n1, _ := strconv.Atoi(p1)
	n2, _ := strconv.Atoi(p2)
	pol, err := egress.Compile([]string{"0.0.0.0/0", "::/0"}, []int{n1, n2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, Config{Egress: pol})
	cases := []struct {
		method, target string
		rule           egress.Rule
	}{
		{http.MethodConnect, "0.0.0.0:" + p1, egress.RuleUnspecified},
		{http.MethodGet, "http://0.0.0.0:" + p1 + "/", egress.RuleUnspecified},
		{http.MethodConnect, "[::]:" + p1, egress.RuleUnspecified},
		{http.MethodConnect, "[::ffff:0.0.0.0]:" + p1, egress.RuleUnspecified},
		{http.MethodConnect, "127.0.0.1:" + p1, egress.RuleLoopback},
		{http.MethodConnect, "[::ffff:127.0.0.1]:" + p1, egress.RuleLoopback},
		{http.MethodConnect, "[64:ff9b::7f00:1]:" + p1, egress.RuleLoopback},
		{http.MethodConnect, "[::7f00:1]:" + p1, egress.RuleLoopback},
		{http.MethodConnect, "localhost:" + p1, egress.RuleLoopback},
		{http.MethodGet, "http://127.0.0.2:" + p2 + "/", egress.RuleLoopback},
		{http.MethodConnect, "127.0.0.2:" + p2, egress.RuleLoopback},
		{http.MethodGet, "http://[::ffff:127.0.0.2]:" + p2 + "/", egress.RuleLoopback},
	}
	for _, c := range cases {
		resp, body, took := rawRequest(t, proxy, c.method, c.target)
		t.Run(c.method+" "+c.target, func(t *testing.T) { wantDenied(t, resp, body, took, c.rule) })
	}
	if n := loop.Accepted(); n != 0 {
		t.Errorf("the listener on %s accepted %d connections through the proxy; want none", loop.Addr(), n)
	}
	if n := loop2.Accepted(); n != 0 {
		t.Errorf("the listener on %s accepted %d connections through the proxy; want none", loop2.Addr(), n)
	}
}

// TestRefusedPortNeverResolves: a request to a port no destination may be
// reached on is refused before its host name is looked up, with a resolver
// and a dialer that fail the test if called.
func TestRefusedPortNeverResolves(t *testing.T) {
	resolve := func(_ context.Context, host string) ([]netip.Addr, error) {
		t.Errorf("the proxy looked %s up; a refused port must be refused first", host)
		return nil, errors.New("lookup forbidden by the test")
	}
	pol := egress.Policy{AllowEndpoints: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:8480")}}
	proxy := startProxy(t, Config{Egress: pol, Resolve: resolve, Dial: failingDial(t), OwnAddrs: func() ([]netip.Addr, error) { return nil, nil }})
	for _, c := range []struct{ method, target string }{
		{http.MethodConnect, "nats.internal.test:4222"},
		{http.MethodConnect, "crawl.example.test:22"},
		{http.MethodConnect, "crawl.example.test:80"},
		{http.MethodConnect, "crawl.example.test:8481"},
		{http.MethodGet, "http://crawl.example.test:8080/"},
		{http.MethodGet, "http://crawl.example.test:8481/"},
	} {
		resp, body, took := rawRequest(t, proxy, c.method, c.target)
		t.Run(c.method+" "+c.target, func(t *testing.T) { wantDenied(t, resp, body, took, egress.RulePort) })
	}
}
