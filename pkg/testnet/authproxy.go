package testnet

import (
	"encoding/base64"
	"io"
	"maps"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// AuthProxy is an upstream HTTP forward proxy as a seller runs one, on
// loopback: plain requests and CONNECT tunnels, behind its own basic-auth
// pair. It records every Proxy-Authorization it is sent, refuses any
// other than its own with a 407, and names itself to the origin in the
// X-Seller header of the plain requests it relays.
type AuthProxy struct {
	// Addr is the proxy's "127.0.0.1:port".
	Addr string

	name, user, pass string

	mu       sync.Mutex
	seen     map[string]int // decoded "user:password" pairs, by count
	served   int
	rejected int
}

// NewAuthProxy starts an [AuthProxy] named name demanding user and pass;
// it stops when the test ends.
func NewAuthProxy(t testing.TB, name, user, pass string) *AuthProxy {
	t.Helper()
	p := &AuthProxy{name: name, user: user, pass: pass, seen: map[string]int{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.Addr = ln.Addr().String()
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return p
}

// ServeHTTP checks the client's credentials, then relays the request or
// opens the tunnel.
func (p *AuthProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	raw, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(r.Header.Get("Proxy-Authorization"), "Basic "))
	p.mu.Lock()
	p.seen[string(raw)]++
	ok := string(raw) == p.user+":"+p.pass
	if ok {
		p.served++
	} else {
		p.rejected++
	}
	p.mu.Unlock()
	if !ok {
		w.Header().Set("Proxy-Authenticate", `Basic realm="seller"`)
		http.Error(w, "proxy authentication required", http.StatusProxyAuthRequired)
		return
	}
	if r.Method == http.MethodConnect {
		up, err := net.DialTimeout("tcp", r.Host, 5*time.Second)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		down, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			_ = up.Close()
			return
		}
		_, _ = io.WriteString(down, "HTTP/1.1 200 Connection established\r\n\r\n")
		go func() { _, _ = io.Copy(up, down); _ = up.Close() }()
		_, _ = io.Copy(down, up)
		_ = down.Close()
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Header.Del("Proxy-Authorization")
	out.Header.Set("X-Seller", p.name)
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

// Pairs returns the credentials the proxy was sent ("user:password" by
// count), and how often it served and refused.
func (p *AuthProxy) Pairs() (seen map[string]int, served, rejected int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.seen), p.served, p.rejected
}
