package forward

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// syncBuffer is a log a child process writes while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// builtinProxies starts n of the fleet's built-in forward proxies ("local-agent
// proxy", built for the test), each a process of its own on a loopback port
// the kernel chose, allowed to reach only the allow endpoints (ip:port). It
// returns their addresses and their logs.
func builtinProxies(t *testing.T, n int, allow ...string) ([]string, []*syncBuffer) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "local-agent")
	if out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", bin, "proxyfleet/services/local-agent/cmd/local-agent").CombinedOutput(); err != nil {
		t.Fatalf("build local-agent: %v\n%s", err, out)
	}
	var addrs []string
	var logs []*syncBuffer
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		f, err := ln.(*net.TCPListener).File()
		_ = ln.Close()
		if err != nil {
			t.Fatal(err)
		}
		log := &syncBuffer{}
		cmd := exec.Command(bin, "proxy", "--listen", ln.Addr().String(), "--listen-fd", "3",
			"--egress-allow", strings.Join(allow, ","))
		cmd.ExtraFiles = []*os.File{f}
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		_ = f.Close()
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		addrs = append(addrs, ln.Addr().String())
		logs = append(logs, log)
	}
	return addrs, logs
}

func (h *harness) suspects() []string {
	h.fleet.mu.Lock()
	defer h.fleet.mu.Unlock()
	return append([]string(nil), h.fleet.suspects...)
}

func TestASiteCannotFakeAProxyFailure(t *testing.T) {
	// The site answers 502 with both markers a proxy's error page has
	// carried: proxyfleet's and Squid's.
	site := testnet.Raw(t, "HTTP/1.1 502 Bad Gateway\r\n"+events.ProxyErrorHeader+": origin unreachable\r\n"+
		events.SquidErrorHeader+": ERR_CONNECT_FAIL 111\r\nContent-Length: 4\r\n", "site")

	t.Run("through the built-in proxies", func(t *testing.T) {
		addrs, _ := builtinProxies(t, 3, site)
		h := newHarnessAt(t, &recordingFleet{}, nil, addrs...)
		code, body, hdr := get(t, h.client("p"), "http://"+site+"/")
		if code != http.StatusBadGateway || body != "site" {
			t.Errorf("the site's 502: %d %q, want it relayed: 502 %q", code, body, "site")
		}
		if v := hdr.Get(events.ProxyErrorHeader); v != "" {
			t.Errorf("the client got the site's %s %q; the proxy must remove it", events.ProxyErrorHeader, v)
		}
		if s := h.suspects(); len(s) != 0 {
			t.Errorf("proxies reported suspect for the site's 502: %v; want none", s)
		}
		if st := h.srv.Stats().Snapshot()["p"]; st.Requests != 1 || len(st.Proxies) != 1 {
			t.Errorf("stats: %d requests over %d proxies; want one attempt at one proxy", st.Requests, len(st.Proxies))
		}
	})

	t.Run("X-Squid-Error is not trusted", func(t *testing.T) {
		// A proxy that relays the site's headers unchanged, as Squid
		// relays an origin's X-Squid-Error.
		site := testnet.Raw(t, "HTTP/1.1 502 Bad Gateway\r\n"+events.SquidErrorHeader+": ERR_CONNECT_FAIL 111\r\nContent-Length: 4\r\n", "site")
		ups := []*upstream{newUpstream(t, ""), newUpstream(t, ""), newUpstream(t, "")}
		h := newHarness(t, &recordingFleet{}, nil, ups...)
		code, body, _ := get(t, h.client("p"), "http://"+site+"/")
		n := ups[0].requests.Load() + ups[1].requests.Load() + ups[2].requests.Load()
		if code != http.StatusBadGateway || body != "site" || n != 1 {
			t.Errorf("a 502 with %s: %d %q after %d attempts; want it relayed after one", events.SquidErrorHeader, code, body, n)
		}
		if s := h.suspects(); len(s) != 0 {
			t.Errorf("proxies reported suspect: %v; want none", s)
		}
	})
}

func TestHTTPSAbsoluteFormRefusalIsRelayedOnce(t *testing.T) {
	// The proxies may reach only the site; the target is refused by
	// their egress policy (loopback).
	site := testnet.Raw(t, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", "ok")
	refused := testnet.Refusing(t).String()
	addrs, logs := builtinProxies(t, 3, site)
	h := newHarnessAt(t, &recordingFleet{}, nil, addrs...)

	conn, err := net.Dial("tcp", h.gw.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	auth := base64.StdEncoding.EncodeToString([]byte("p:x"))
	_, _ = io.WriteString(conn, "GET https://"+refused+"/page HTTP/1.1\r\nHost: "+refused+"\r\nProxy-Authorization: Basic "+auth+"\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || !strings.HasPrefix(resp.Header.Get(egress.Header), "denied ") {
		t.Errorf("GET https://%s/ in absolute form, refused by the proxy: %d %s %q; want 403 with the rule", refused, resp.StatusCode, egress.Header, resp.Header.Get(egress.Header))
	}
	if s := h.suspects(); len(s) != 0 {
		t.Errorf("proxies reported suspect for refusing a target: %v; want none", s)
	}
	denied := 0
	for _, l := range logs {
		denied += strings.Count(l.String(), "egress denied")
	}
	if denied != 1 {
		t.Errorf("the proxies refused the target %d times; want once (no retry on the others)", denied)
	}
	// No proxy was cooled: three requests to the site go through all three.
	seen := map[string]bool{}
	for range 3 {
		code, _, hdr := get(t, h.client("p"), "http://"+site+"/")
		if code != http.StatusOK {
			t.Fatalf("GET the site after the refusal: %d", code)
		}
		seen[hdr.Get(ProxyHeader)] = true
	}
	if len(seen) != 3 {
		t.Errorf("after the refusal the site was reached through %v; want all three proxies (none cooled)", seen)
	}
}

func TestConnectionListedFieldsAreNotRelayed(t *testing.T) {
	head := "HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nX-Hop: hop\r\nX-End: kept\r\nContent-Length: 2\r\n"

	t.Run("from a proxy that relays them", func(t *testing.T) {
		// The proxy answers with the header as a site would send it.
		h := newHarnessAt(t, &recordingFleet{}, nil, testnet.Raw(t, head, "ok"))
		code, body, hdr := get(t, h.client("p"), "http://site.test/")
		if code != http.StatusOK || body != "ok" || hdr.Get("X-End") != "kept" {
			t.Fatalf("through the gateway: %d %q X-End %q; want 200 %q X-End kept", code, body, hdr.Get("X-End"), "ok")
		}
		if v := hdr.Get("X-Hop"); v != "" {
			t.Errorf("X-Hop, listed in Connection, reached the client: %q", v)
		}
	})

	t.Run("from a site through the built-in proxy", func(t *testing.T) {
		site := testnet.Raw(t, head, "ok")
		addrs, _ := builtinProxies(t, 1, site)
		h := newHarnessAt(t, &recordingFleet{}, nil, addrs...)
		code, body, hdr := get(t, h.client("p"), "http://"+site+"/")
		if code != http.StatusOK || body != "ok" || hdr.Get("X-End") != "kept" || hdr.Get("X-Hop") != "" {
			t.Errorf("through the proxy and the gateway: %d %q X-End %q X-Hop %q; want 200 %q, kept, none", code, body, hdr.Get("X-End"), hdr.Get("X-Hop"), "ok")
		}
	})

	t.Run("towards the proxy", func(t *testing.T) {
		site := origin(t, func(w http.ResponseWriter, r *http.Request) {})
		u := newUpstream(t, "")
		h := newHarness(t, &recordingFleet{}, nil, u)
		req, _ := http.NewRequest(http.MethodGet, site.URL+"/", nil)
		req.Header.Set("Connection", "X-Client-Hop")
		req.Header.Set("X-Client-Hop", "hop")
		req.Header.Set("X-Client-End", "kept")
		resp, err := h.client("p").Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		u.mu.Lock()
		defer u.mu.Unlock()
		if len(u.seenHdr) != 1 || u.seenHdr[0].Get("X-Client-Hop") != "" || u.seenHdr[0].Get("X-Client-End") != "kept" {
			t.Errorf("the proxy saw %v; want X-Client-End and no X-Client-Hop", u.seenHdr)
		}
	})
}
