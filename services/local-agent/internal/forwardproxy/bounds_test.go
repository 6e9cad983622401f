package forwardproxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// TestStalledBodyIsCut: a request whose body stops arriving is answered
// 408 after the body timeout, not marked as the proxy's own failure, and
// never completes at the origin.
func TestStalledBodyIsCut(t *testing.T) {
	var complete atomic.Int32
	site := echoOrigin(t)
	site.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err == nil {
			complete.Add(1)
		}
	})
	const after = 300 * time.Millisecond
	proxy := startProxy(t, Config{Egress: allow(t, site.URL), BodyTimeout: after})
	conn, err := net.Dial("tcp", proxy.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	start := time.Now()
	_, _ = fmt.Fprintf(conn, "POST %s/upload HTTP/1.1\r\nHost: %s\r\nContent-Length: 100000\r\n\r\nonly this", site.URL, strings.TrimPrefix(site.URL, "http://"))
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a stalled body: %v", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || resp.Header.Get(events.ProxyErrorHeader) != "" {
		t.Errorf("stalled body: %d %s %q; want 408 without it", resp.StatusCode, events.ProxyErrorHeader, resp.Header.Get(events.ProxyErrorHeader))
	}
	if took := time.Since(start); took < after {
		t.Errorf("answered after %s, before the body timeout", took)
	}
	if complete.Load() != 0 {
		t.Error("the origin read a complete body")
	}
}

func openTunnel(t *testing.T, proxy, target string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", proxy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_, _ = io.WriteString(c, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT %s: %v %v", target, resp, err)
	}
	_ = c.SetReadDeadline(time.Time{})
	return c
}

// TestIdleTunnelIsClosedAndAnActiveOneIsNot: the tunnel that carries
// nothing is closed after the idle timeout; the one that carries a
// message every tenth of it stays open.
func TestIdleTunnelIsClosedAndAnActiveOneIsNot(t *testing.T) {
	const idleAfter = 400 * time.Millisecond
	echo := testnet.Echo(t)
	proxy := startProxy(t, Config{Egress: allow(t, echo), TunnelIdleTimeout: idleAfter})
	active, quiet := openTunnel(t, proxy.Host, echo), openTunnel(t, proxy.Host, echo)
	start := time.Now()
	closed := make(chan time.Time, 1)
	go func() {
		_ = quiet.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, _ = quiet.Read(make([]byte, 1))
		closed <- time.Now()
	}()
	ping := func(when string) {
		t.Helper()
		_ = active.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := active.Write([]byte("ping")); err != nil {
			t.Fatalf("active tunnel %s: %v", when, err)
		}
		if _, err := io.ReadFull(active, make([]byte, 4)); err != nil {
			t.Fatalf("active tunnel %s: %v", when, err)
		}
	}
	for {
		ping("while the quiet one is open")
		select {
		case at := <-closed:
			if idle := at.Sub(start); idle < idleAfter {
				t.Errorf("the quiet tunnel closed after %s, before the idle timeout", idle)
			}
			for range 30 {
				time.Sleep(idleAfter / 10)
				ping("after the quiet one closed")
			}
			return
		default:
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("the quiet tunnel is still open after 30s, with an idle timeout of %s", idleAfter)
		}
		time.Sleep(idleAfter / 10) // the pace of the active tunnel's messages
	}
}
