package local

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// agentBin is the local-agent binary built once for this package's tests:
// the driver runs it as "local-agent proxy", and the crash test runs it as
// the agent.
var agentBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "local-agent-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	agentBin = filepath.Join(dir, "local-agent")
	build := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", agentBin, "../../cmd/local-agent")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build local-agent:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// testPorts returns a port range of 40 ports below the ephemeral range, at a
// random place so parallel test runs rarely share one (the driver skips
// ports it cannot bind anyway), for the tests of range allocation itself;
// the others let the kernel choose.
func testPorts() PortRange {
	first := 21000 + rand.IntN(10000)
	return PortRange{First: first, Last: first + 39}
}

// newDriver returns a driver on stateDir (a fresh one when empty) that
// deletes every instance it knows at the end of the test.
func newDriver(t *testing.T, cfg Config) *Driver {
	t.Helper()
	if cfg.StateDir == "" {
		cfg.StateDir = t.TempDir()
	}
	if cfg.Ports.Kernel() && cfg.Squid == "" && cfg.Capacity == 0 {
		cfg.Capacity = 40
	} else if cfg.Ports.Kernel() && cfg.Squid != "" {
		cfg.Ports = testPorts() // Squid binds the port it is told
	}
	if cfg.Executable == "" {
		cfg.Executable = agentBin
	}
	if cfg.Entry == "" {
		cfg.Entry, cfg.Target = "local", "test"
	}
	d, err := New(cfg, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { cleanupAll(t, d) })
	return d
}

func cleanupAll(t *testing.T, d *Driver) {
	list, _ := d.List(context.Background())
	for _, inst := range list {
		if err := d.Delete(context.Background(), agent.Ref{Name: inst.Name}); err != nil {
			t.Errorf("cleanup: delete %s: %v", inst.Name, err)
		}
	}
}

func spec(proxyID string) agent.Spec {
	return agent.Spec{ProxyID: proxyID, Pool: "demo", Entry: "local", Target: "test", Name: events.InstanceName(proxyID), Attempt: 1, Port: 3128}
}

func withEgress(sp agent.Spec, p egress.Policy) agent.Spec {
	sp.Egress = p
	return sp
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// origin is a loopback HTTP server answering "hello <path>" and the client
// address it saw in X-Remote.
func origin(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("X-Remote", host)
		_, _ = io.WriteString(w, "hello "+r.URL.Path)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// endpoint is the ip:port of a test server, for the egress policy: the
// proxies refuse loopback unless an endpoint is allowed.
func endpoint(t *testing.T, o *httptest.Server) netip.AddrPort {
	t.Helper()
	ap, err := netip.ParseAddrPort(o.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return ap
}

// allowing is the default egress policy with the test servers allowed.
func allowing(t *testing.T, servers ...*httptest.Server) egress.Policy {
	t.Helper()
	var p egress.Policy
	for _, o := range servers {
		p.AllowEndpoints = append(p.AllowEndpoints, endpoint(t, o))
	}
	return p
}

// getVia fetches target through the proxy at addr (with credentials when
// user is set) and returns the status, body and X-Remote header.
func getVia(t *testing.T, addr, user, pass, target string) (int, string, string) {
	t.Helper()
	pu := &url.URL{Scheme: "http", Host: addr}
	if user != "" {
		pu.User = url.UserPassword(user, pass)
	}
	c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(pu), DisableKeepAlives: true}}
	resp, err := c.Get(target)
	if err != nil {
		t.Fatalf("GET %s via %s: %v", target, addr, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get("X-Remote")
}

// wantServes fails t unless a GET through addr reaches origin.
func wantServes(t *testing.T, addr string, o *httptest.Server) {
	t.Helper()
	code, body, _ := getVia(t, addr, "", "", o.URL+"/through")
	if code != http.StatusOK || body != "hello /through" {
		t.Fatalf("GET via %s = %d %q, want 200 %q", addr, code, body, "hello /through")
	}
}

// processGone reports whether pid no longer runs (absent or a zombie
// nobody reaped).
func processGone(pid int) bool {
	p, err := readProc(pid)
	return err != nil || !p.running()
}

// eventually waits for cond within the 30s the tests of this package
// allow each condition.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, 30*time.Second, what, cond)
}
