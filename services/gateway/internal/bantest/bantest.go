// Package bantest starts what the gateway's ban tests route through, all
// on loopback: forward proxies that each reach sites from a loopback
// address of their own (as the fleet's proxies have their own public
// addresses), and sites that ban by the address a request comes from.
package bantest

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
)

// Proxy starts a forward proxy for absolute-form (plain HTTP) requests
// that reaches sites from source (a loopback IP such as "127.0.0.2"),
// until the test ends, and returns its address.
func Proxy(t testing.TB, source string) string {
	t.Helper()
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(source)}}
	tr := &http.Transport{DialContext: dialer.DialContext}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		out := r.Clone(r.Context())
		out.RequestURI = ""
		out.Header.Del("Proxy-Authorization")
		resp, err := tr.RoundTrip(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer func() { _ = resp.Body.Close() }()
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(tr.CloseIdleConnections)
	return srv.Listener.Addr().String()
}

// BanPage is the body of a site's ban page.
const BanPage = "access denied: your address is blocked"

// Site is a web site on a loopback IP of its own (its own site.Key). It
// answers a request from a banned address 403 with [BanPage], any other
// "hello", and counts the requests per address.
type Site struct {
	URL string
	// Host is the site's host:port.
	Host string

	mu     sync.Mutex
	banned map[string]bool
	seen   map[string]int
}

// NewSite starts a site on ip (such as "127.0.0.10") until the test ends,
// banning the addresses banned.
func NewSite(t testing.TB, ip string, banned ...string) *Site {
	t.Helper()
	s := &Site{banned: map[string]bool{}, seen: map[string]int{}}
	for _, b := range banned {
		s.banned[b] = true
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("bantest: listen on %s: %v", ip, err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		from, _, _ := net.SplitHostPort(r.RemoteAddr)
		s.mu.Lock()
		s.seen[from]++
		banned := s.banned[from]
		s.mu.Unlock()
		if banned {
			http.Error(w, BanPage, http.StatusForbidden)
			return
		}
		_, _ = io.WriteString(w, "hello")
	}))
	_ = srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	s.URL, s.Host = srv.URL, ln.Addr().String()
	return s
}

// Ban bans address from now on.
func (s *Site) Ban(address string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.banned[address] = true
}

// Seen returns how many requests came from address.
func (s *Site) Seen(address string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[address]
}
