package forward

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/route"
)

// boundedGateway serves a gateway over the upstream proxy u with cfg's
// bounds, on a listener capped at connsPerClient (0: uncapped).
func boundedGateway(t *testing.T, fleet *recordingFleet, u *upstream, cfg Config, connsPerClient int) (string, *Server) {
	t.Helper()
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "p-a", Pool: "p", Address: u.addr()})
	cfg.Table, cfg.Fleet = table, fleet
	if cfg.Auth == nil {
		cfg.Auth = func(_, _, pw string) (bool, error) { return pw == "x", nil }
	}
	cfg.DialTimeout, cfg.ResponseTimeout = 5*time.Second, 20*time.Second
	srv := New(cfg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &httptest.Server{Listener: LimitListener(ln, connsPerClient), Config: &http.Server{Handler: srv}}
	hs.Start()
	t.Cleanup(hs.Close)
	t.Cleanup(srv.Close)
	return ln.Addr().String(), srv
}

var testAuth = "Basic " + base64.StdEncoding.EncodeToString([]byte("p:x"))

// answer reads the status line of the answer on c, within 20s.
func answer(t *testing.T, c net.Conn) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the answer: %v (got %q)", err, line)
	}
	_ = c.SetReadDeadline(time.Time{})
	return strings.TrimSpace(line)
}

// TestStalledBodyIsCut: a request whose body stops arriving is answered
// 408 after the body timeout, whether the body was to be kept for a retry
// or streamed, and no proxy is blamed for it.
func TestStalledBodyIsCut(t *testing.T) {
	var reached atomic.Int32
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
	})
	for _, c := range []struct {
		name      string
		length    int
		sent      int
		mayArrive bool // a streamed body's request may reach the site before the stall
	}{
		{"kept for a retry", 100, 3, false},
		{"streamed", 2*maxReplayBody + 1000, maxReplayBody + 5000, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			reached.Store(0)
			fleet := &recordingFleet{}
			gw, _ := boundedGateway(t, fleet, newUpstream(t, ""), Config{BodyTimeout: 300 * time.Millisecond}, 0)
			conn, err := net.Dial("tcp", gw)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.Close() }()
			head := fmt.Sprintf("POST %s/upload HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: %s\r\nContent-Length: %d\r\n\r\n",
				site.URL, strings.TrimPrefix(site.URL, "http://"), testAuth, c.length)
			go func() { _, _ = conn.Write(append([]byte(head), bytes.Repeat([]byte("b"), c.sent)...)) }()
			start := time.Now()
			if got := answer(t, conn); !strings.HasPrefix(got, "HTTP/1.1 408") {
				t.Fatalf("answer to a stalled body: %q; want 408", got)
			}
			if took := time.Since(start); took < 300*time.Millisecond {
				t.Errorf("answered after %s, before the body timeout", took)
			}
			if !c.mayArrive && reached.Load() != 0 {
				t.Errorf("the site got %d requests of a body never complete", reached.Load())
			}
			if len(fleet.suspects) != 0 {
				t.Errorf("proxies suspected for the client's stall: %v", fleet.suspects)
			}
		})
	}
}

// dialTunnel opens a tunnel through the gateway gw to target from the
// local address from ("" for any) and returns it with the answer's status
// line.
func dialTunnel(t *testing.T, gw, from, target string) (net.Conn, string) {
	t.Helper()
	d := net.Dialer{Timeout: 10 * time.Second}
	if from != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
	}
	c, err := d.Dial("tcp", gw)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_, _ = io.WriteString(c, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\nProxy-Authorization: "+testAuth+"\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		// A refused connection may be closed before or after its answer.
		return c, "error: " + err.Error()
	}
	_ = c.SetReadDeadline(time.Time{})
	if resp.StatusCode == http.StatusOK && br.Buffered() > 0 {
		t.Fatalf("%d bytes after the answer to CONNECT", br.Buffered())
	}
	return c, resp.Status
}

// TestIdleTunnelIsClosedAndAnActiveOneIsNot: of two tunnels through the
// gateway, the one that carries nothing is closed after the idle timeout;
// the one that carries a message every tenth of it stays open.
func TestIdleTunnelIsClosedAndAnActiveOneIsNot(t *testing.T) {
	const idleAfter = 400 * time.Millisecond
	echo := testnet.Echo(t)
	gw, _ := boundedGateway(t, &recordingFleet{}, newUpstream(t, ""), Config{TunnelIdleTimeout: idleAfter}, 0)
	active, status := dialTunnel(t, gw, "", echo)
	if status != "200 Connection established" {
		t.Fatalf("CONNECT: %s", status)
	}
	quiet, status := dialTunnel(t, gw, "", echo)
	if status != "200 Connection established" {
		t.Fatalf("CONNECT: %s", status)
	}
	closed := make(chan time.Time, 1)
	start := time.Now()
	go func() {
		_ = quiet.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, _ = quiet.Read(make([]byte, 1))
		closed <- time.Now()
	}()
	msg := []byte("ping")
	buf := make([]byte, len(msg))
	for i := 0; ; i++ {
		_ = active.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := active.Write(msg); err != nil {
			t.Fatalf("active tunnel, message %d: %v", i, err)
		}
		if _, err := io.ReadFull(active, buf); err != nil {
			t.Fatalf("active tunnel, echo %d after %s: %v", i, time.Since(start), err)
		}
		select {
		case at := <-closed:
			if idle := at.Sub(start); idle < idleAfter {
				t.Errorf("the quiet tunnel closed after %s, before the idle timeout", idle)
			}
			// The active tunnel outlives it by several idle timeouts.
			for range 30 {
				time.Sleep(idleAfter / 10)
				if _, err := active.Write(msg); err != nil {
					t.Fatalf("active tunnel after the quiet one closed: %v", err)
				}
				if _, err := io.ReadFull(active, buf); err != nil {
					t.Fatalf("active tunnel after the quiet one closed: %v", err)
				}
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

// TestConnectionsPerClientAreCapped: a client address at its cap gets 429
// for one more connection, another address does not, and a closed
// connection frees its place.
func TestConnectionsPerClientAreCapped(t *testing.T) {
	echo := testnet.Echo(t)
	gw, _ := boundedGateway(t, &recordingFleet{}, newUpstream(t, ""), Config{}, 2)
	first, status := dialTunnel(t, gw, "127.0.0.1", echo)
	if status != "200 Connection established" {
		t.Fatalf("tunnel 1: %s", status)
	}
	if _, status := dialTunnel(t, gw, "127.0.0.1", echo); status != "200 Connection established" {
		t.Fatalf("tunnel 2: %s", status)
	}
	if _, status := dialTunnel(t, gw, "127.0.0.1", echo); !strings.HasPrefix(status, "429") {
		t.Fatalf("connection 3 of 127.0.0.1 with a cap of 2: %s; want 429", status)
	}
	if _, status := dialTunnel(t, gw, "127.0.0.2", echo); status != "200 Connection established" {
		t.Fatalf("127.0.0.2 while 127.0.0.1 is at its cap: %s", status)
	}
	_ = first.Close()
	testwait.Until(t, 20*time.Second, "a place freed by a closed tunnel", func() bool {
		c, status := dialTunnel(t, gw, "127.0.0.1", echo)
		_ = c.Close()
		return status == "200 Connection established"
	})
}

// TestThrottledLoginIsAnswered429: a login the authenticator throttles is
// answered 429 with Retry-After, not 407.
func TestThrottledLoginIsAnswered429(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, r *http.Request) {})
	gw, _ := boundedGateway(t, &recordingFleet{}, newUpstream(t, ""), Config{Auth: func(client, _, _ string) (bool, error) {
		return false, throttled{client}
	}}, 0)
	req, _ := http.NewRequest(http.MethodGet, site.URL, nil)
	req.Header.Set("Proxy-Authorization", testAuth)
	c, err := net.Dial("tcp", gw)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	if err := req.WriteProxy(c); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "3" || !strings.Contains(string(body), "too many failed logins from 127.0.0.1") {
		t.Errorf("throttled login: %d Retry-After %q %q; want 429, 3 and the reason", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
}

type throttled struct{ client string }

func (e throttled) Error() string             { return "too many failed logins from " + e.client }
func (e throttled) RetryAfter() time.Duration { return 2500 * time.Millisecond }
