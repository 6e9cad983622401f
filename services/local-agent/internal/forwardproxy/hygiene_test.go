package forwardproxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

func TestOriginCannotSetTheProxyErrorMarker(t *testing.T) {
	// A site answers 502 with the marker the gateway takes for this
	// proxy's own failure.
	site := testnet.Raw(t, "HTTP/1.1 502 Bad Gateway\r\n"+
		events.ProxyErrorHeader+": origin unreachable\r\nContent-Length: 4\r\n", "site")
	dead := testnet.Refusing(t).String()
	proxy := startProxy(t, Config{Egress: allow(t, site, dead)})
	c := client(proxy, nil)

	resp, err := c.Get("http://" + site + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway || string(body) != "site" {
		t.Fatalf("the site's 502: %d %q, want it relayed: 502 %q", resp.StatusCode, body, "site")
	}
	if v := resp.Header.Get(events.ProxyErrorHeader); v != "" {
		t.Errorf("the site's %s: %q was relayed; only the proxy may set it", events.ProxyErrorHeader, v)
	}

	// The proxy's own failure still carries it.
	resp, err = c.Get("http://" + dead + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway || resp.Header.Get(events.ProxyErrorHeader) == "" {
		t.Errorf("an unreachable origin: %d with %s %q, want 502 with the marker", resp.StatusCode, events.ProxyErrorHeader, resp.Header.Get(events.ProxyErrorHeader))
	}
}

func TestConnectionListedFieldsAreNotForwarded(t *testing.T) {
	// Go's client drops a Connection header that holds "close" as a
	// whole, the fields it lists along with it.
	site := testnet.Raw(t, "HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nX-Hop: origin-hop\r\n"+
		"X-End: kept\r\nContent-Length: 2\r\n", "ok")
	proxy := startProxy(t, Config{Egress: allow(t, site)})
	resp, err := client(proxy, nil).Get("http://" + site + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok" || resp.Header.Get("X-End") != "kept" {
		t.Fatalf("through the proxy: %d %q X-End %q, want 200 %q X-End kept", resp.StatusCode, body, resp.Header.Get("X-End"), "ok")
	}
	if v := resp.Header.Get("X-Hop"); v != "" {
		t.Errorf("X-Hop, listed in the origin's Connection header, was relayed: %q", v)
	}

	// And towards the origin: the fields the client's Connection lists.
	seen := make(chan http.Header, 1)
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
	}))
	t.Cleanup(echo.Close)
	proxy = startProxy(t, Config{Egress: allow(t, echo.Listener.Addr().String())})
	req, _ := http.NewRequest(http.MethodGet, echo.URL+"/", nil)
	req.Header.Set("Connection", "X-Client-Hop")
	req.Header.Set("X-Client-Hop", "client-hop")
	req.Header.Set("X-Client-End", "kept")
	resp, err = client(proxy, nil).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	h := <-seen
	if h.Get("X-Client-Hop") != "" || h.Get("X-Client-End") != "kept" {
		t.Errorf("the origin saw X-Client-Hop %q and X-Client-End %q; want none and kept", h.Get("X-Client-Hop"), h.Get("X-Client-End"))
	}
}
