package e2e_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// TestEgressThroughReadyProxy: through a ready proxy of the built-in
// backend (ready means health's probes reached the echo endpoint through
// it), CONNECT to the NATS port and a GET to a server on this host's own
// address are refused at once with 403 naming the rule.
func TestEgressThroughReadyProxy(t *testing.T) {
	egressThroughReadyProxy(t, newFleet(t))
}

// TestEgressThroughReadyProxySquid is the same through real Squid proxies
// (make test-e2e-squid sets PROXYFLEET_SQUID).
func TestEgressThroughReadyProxySquid(t *testing.T) {
	egressThroughReadyProxy(t, newSquidFleet(t))
}

func egressThroughReadyProxy(t *testing.T, f *fleet) {
	f.dumpLogsOnFailure()
	f.startAll()
	f.apply(events.PoolSpec{Name: "egress", Provider: "local", Size: 1})
	// The proxy outlives the services (an agent's restart adopts it): the
	// pool goes before they stop, so no proxy is left behind.
	t.Cleanup(func() { f.deletePoolAndWait("egress") })
	p := f.waitPool("egress", 1, "ready", 90*time.Second)[0]

	nats, err := url.Parse(f.conn.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	status, rule, body, took := requestThrough(t, p.Address, http.MethodConnect, nats.Host)
	if status != http.StatusForbidden || rule == "" || took > 2*time.Second {
		t.Fatalf("CONNECT %s (NATS) through %s: %d %q after %v, want 403 naming a rule at once", nats.Host, p.Address, status, rule, took)
	}
	if strings.Contains(body, "INFO {") {
		t.Fatalf("the NATS banner came through: %q", body)
	}

	// A stand-in for any service on this host: never reached.
	loop := testnet.Count(t, "127.0.0.1:0", "")
	for _, m := range []string{http.MethodConnect, http.MethodGet} {
		target := loop.Addr().String()
		if m == http.MethodGet {
			target = "http://" + target + "/"
		}
		if status, rule, _, took := requestThrough(t, p.Address, m, target); status != http.StatusForbidden || rule == "" || took > 2*time.Second {
			t.Errorf("%s %s: %d %q after %v, want 403 naming a rule at once", m, target, status, rule, took)
		}
	}

	// A server on this host's own non-loopback address.
	var own net.IP
	if addrs, err := egress.HostAddrs(); err == nil {
		for _, a := range addrs {
			if a.Is4() && !a.IsLoopback() && !a.IsLinkLocalUnicast() {
				own = net.IP(a.AsSlice())
				break
			}
		}
	}
	if own != nil {
		srv := testnet.Count(t, net.JoinHostPort(own.String(), "0"), "")
		target := "http://" + srv.Addr().String() + "/"
		if status, rule, _, took := requestThrough(t, p.Address, http.MethodGet, target); status != http.StatusForbidden || rule == "" || took > 2*time.Second {
			t.Errorf("GET %s (this host's own address): %d %q after %v, want 403 naming a rule at once", target, status, rule, took)
		}
		if n := srv.Accepted(); n != 0 {
			t.Errorf("the server on this host's own address saw %d connections, want none", n)
		}
	} else {
		t.Log("this host has no non-loopback IPv4 address: the own-address request is left out")
	}
	if n := loop.Accepted(); n != 0 {
		t.Errorf("the loopback listener saw %d connections, want none", n)
	}
}

// requestThrough sends one CONNECT or absolute-URI request through the
// proxy at addr and returns the status, the rule the refusal names (the
// built-in proxy's X-Proxyfleet-Egress, Squid's X-Squid-Error page), the
// start of the body and how long the answer took.
func requestThrough(t *testing.T, addr, method, target string) (int, string, string, time.Duration) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
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
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s through %s: %v", method, target, addr, err)
	}
	took := time.Since(start)
	var body []byte
	if method == http.MethodConnect && resp.StatusCode == http.StatusOK {
		// A tunnel: what the destination says first.
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		body, _ = io.ReadAll(io.LimitReader(br, 512))
	} else {
		body, _ = io.ReadAll(io.LimitReader(resp.Body, 4096))
	}
	resp.Body.Close()
	rule := resp.Header.Get(egress.Header)
	if se := resp.Header.Get("X-Squid-Error"); strings.Contains(se, "ERR_PROXYFLEET_EGRESS_") {
		rule = se
	}
	return resp.StatusCode, rule, string(body), took
}
