package forwardproxy_test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/services/local-agent/internal/forwardproxy"
)

// BenchmarkGET measures one small GET through the built-in proxy against the
// same GET sent straight to the origin in the same run (the baseline), both
// over kept-alive loopback connections. `make bench` prints the ratio.
func BenchmarkGET(b *testing.B) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	defer origin.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := forwardproxy.Server(forwardproxy.New(forwardproxy.Config{Egress: egress.Policy{AllowEndpoints: []netip.AddrPort{netip.MustParseAddrPort(strings.TrimPrefix(origin.URL, "http://"))}}}))
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	proxyURL := &url.URL{Scheme: "http", Host: ln.Addr().String()}

	run := func(b *testing.B, tr *http.Transport) {
		c := &http.Client{Transport: tr}
		defer tr.CloseIdleConnections()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			resp, err := c.Get(origin.URL)
			if err != nil {
				b.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Fatalf("status %d", resp.StatusCode)
			}
		}
	}
	b.Run("baseline", func(b *testing.B) { run(b, &http.Transport{}) })
	b.Run("proxied", func(b *testing.B) { run(b, &http.Transport{Proxy: http.ProxyURL(proxyURL)}) })
}
