package forward

import (
	"encoding/base64"
	"io"
	"net/http"
	"slices"
	"testing"
)

// TestTransportPerProxyFollowsCredentialsAndForget checks that plain HTTP
// requests go through a transport of their proxy's own, that changed
// credentials reach the proxy at once (the old transport dropped), and
// that a proxy that left the fleet leaves no transport behind.
func TestTransportPerProxyFollowsCredentialsAndForget(t *testing.T) {
	site := origin(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") })
	ups := []*upstream{newUpstream(t, ""), newUpstream(t, "")}
	fleet := &recordingFleet{user: "crawl", password: "pw1"}
	h := newHarness(t, fleet, nil, ups...)
	c := h.client("p")
	basic := func(pw string) string { return "Basic " + base64.StdEncoding.EncodeToString([]byte("crawl:"+pw)) }
	getOK := func() {
		t.Helper()
		if code, body, _ := get(t, c, site.URL+"/x"); code != 200 || body != "hello" {
			t.Fatalf("GET through the gateway: %d %q; want 200 hello", code, body)
		}
	}
	for range 4 {
		getOK()
	}
	if n := h.srv.transports.len(); n != 2 {
		t.Fatalf("transports after requests through 2 proxies: %d, want 2", n)
	}
	fleet.setCredentials("crawl", "pw2")
	for range 2 {
		getOK()
	}
	for i, u := range ups {
		u.mu.Lock()
		seen := slices.Clone(u.seenAuth)
		u.mu.Unlock()
		if want := []string{basic("pw1"), basic("pw1"), basic("pw2")}; !slices.Equal(seen, want) {
			t.Errorf("upstream %d got Proxy-Authorization %q; want %q (the new password from the first request after the change)", i, seen, want)
		}
	}
	if n := h.srv.transports.len(); n != 2 {
		t.Errorf("transports after the credentials changed: %d, want 2 (the old ones dropped)", n)
	}
	h.srv.Forget("p-a")
	if n := h.srv.transports.len(); n != 1 {
		t.Errorf("transports after Forget(p-a): %d, want 1", n)
	}
	h.srv.Close()
	if n := h.srv.transports.len(); n != 1 {
		t.Errorf("transports after Close: %d, want 1 (Close only closes idle connections)", n)
	}
}
