package local

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// TestSquidMarksOnlyItsOwnErrors runs the generated squid.conf: a site's
// copy of the proxy-error marker is removed, and Squid's own error page
// carries it, so the gateway retries only what Squid could not carry.
func TestSquidMarksOnlyItsOwnErrors(t *testing.T) {
	d := squidDriver(t, Config{})
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(events.ProxyErrorHeader, "origin unreachable")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = io.WriteString(w, "site")
	}))
	t.Cleanup(site.Close)
	dead := testnet.Refusing(t)
	sp := spec("demo-squidmark")
	sp.Egress = allowing(t, site)
	sp.Egress.AllowEndpoints = append(sp.Egress.AllowEndpoints, netip.MustParseAddrPort(dead.String()))
	inst, err := d.Create(ctxT(t), sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: inst.Address})}}
	fetch := func(target string) (*http.Response, string) {
		t.Helper()
		resp, err := c.Get(target)
		if err != nil {
			t.Fatalf("GET %s via Squid: %v", target, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}

	resp, body := fetch(site.URL + "/")
	if resp.StatusCode != http.StatusBadGateway || body != "site" {
		t.Fatalf("the site's 502 via Squid: %d %q, want it relayed", resp.StatusCode, body)
	}
	if v := resp.Header.Get(events.ProxyErrorHeader); v != "" {
		t.Errorf("the site's %s reached the client: %q; Squid must remove it", events.ProxyErrorHeader, v)
	}

	resp, _ = fetch("http://" + dead.String() + "/")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get(events.ProxyErrorHeader) != "squid ERR_CONNECT_FAIL" {
		t.Errorf("an unreachable origin via Squid: %d with %s %q; want 503 marked %q", resp.StatusCode,
			events.ProxyErrorHeader, resp.Header.Get(events.ProxyErrorHeader), "squid ERR_CONNECT_FAIL")
	}
}
