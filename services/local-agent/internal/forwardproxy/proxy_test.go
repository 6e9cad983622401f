package forwardproxy

import (
	"bufio"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
)

// startProxy serves a proxy for cfg on a loopback port and returns its URL.
func startProxy(t *testing.T, cfg Config) *url.URL {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := Server(New(cfg))
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return &url.URL{Scheme: "http", Host: ln.Addr().String()}
}

// echoOrigin answers with the request's method, path, client address and
// the headers a proxy must strip.
func echoOrigin(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("X-Remote", host)
		w.Header().Set("X-Saw-Proxy-Auth", r.Header.Get("Proxy-Authorization"))
		w.Header().Set("X-Saw-Proxy-Connection", r.Header.Get("Proxy-Connection"))
		_, _ = io.WriteString(w, r.Method+" "+r.URL.Path+" "+string(body))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// allow is the default egress policy plus the given ip:port endpoints (the
// test's own loopback origins, refused otherwise).
func allow(t *testing.T, hostports ...string) egress.Policy {
	t.Helper()
	var p egress.Policy
	for _, hp := range hostports {
		hp = strings.TrimPrefix(strings.TrimPrefix(hp, "http://"), "https://")
		ap, err := netip.ParseAddrPort(hp)
		if err != nil {
			t.Fatalf("allow %q: %v", hp, err)
		}
		p.AllowEndpoints = append(p.AllowEndpoints, ap)
	}
	return p
}

func client(proxy *url.URL, tlsConf *tls.Config) *http.Client {
	return &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy), TLSClientConfig: tlsConf}}
}

func withUser(u *url.URL, user, pass string) *url.URL {
	c := *u
	c.User = url.UserPassword(user, pass)
	return &c
}

func TestForwardsPlainHTTP(t *testing.T) {
	origin := echoOrigin(t)
	proxy := startProxy(t, Config{Egress: allow(t, origin.URL)})
	req, _ := http.NewRequest(http.MethodPost, origin.URL+"/hello", strings.NewReader("body"))
	req.Header.Set("Proxy-Connection", "keep-alive")
	resp, err := client(proxy, nil).Do(req)
	if err != nil {
		t.Fatalf("POST through proxy: %v", err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(got) != "POST /hello body" {
		t.Fatalf("got %d %q, want 200 %q", resp.StatusCode, got, "POST /hello body")
	}
	if v := resp.Header.Get("X-Saw-Proxy-Connection"); v != "" {
		t.Errorf("origin saw Proxy-Connection %q, want it stripped", v)
	}
}

func TestTunnelsCONNECT(t *testing.T) {
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "secure "+r.URL.Path)
	}))
	t.Cleanup(origin.Close)
	proxy := startProxy(t, Config{Egress: allow(t, origin.URL)})
	resp, err := client(proxy, origin.Client().Transport.(*http.Transport).TLSClientConfig).Get(origin.URL + "/x")
	if err != nil {
		t.Fatalf("GET https through proxy: %v", err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	if string(got) != "secure /x" {
		t.Fatalf("got %q, want %q", got, "secure /x")
	}
}

// rawConnect sends a CONNECT with the given Proxy-Authorization value and
// returns the status code.
func rawConnect(t *testing.T, proxy *url.URL, target, authz string) int {
	t.Helper()
	c, err := net.Dial("tcp", proxy.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := "CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n"
	if authz != "" {
		req += "Proxy-Authorization: " + authz + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("read CONNECT response: %v", err)
	}
	if resp.StatusCode == http.StatusProxyAuthRequired && resp.Header.Get("Proxy-Authenticate") != `Basic realm="proxyfleet"` {
		t.Errorf("407 without Proxy-Authenticate: %v", resp.Header)
	}
	return resp.StatusCode
}

func basic(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

func TestBasicAuth(t *testing.T) {
	origin := echoOrigin(t)
	proxy := startProxy(t, Config{Auth: &Credentials{Username: "crawler", Password: "s3cret"}, Egress: allow(t, origin.URL)})
	target := strings.TrimPrefix(origin.URL, "http://")
	cases := []struct {
		name       string
		user, pass string
		authz      string
		want       int
	}{
		{name: "ok", user: "crawler", pass: "s3cret", authz: basic("crawler", "s3cret"), want: http.StatusOK},
		{name: "missing", want: http.StatusProxyAuthRequired},
		{name: "wrong password", user: "crawler", pass: "nope", authz: basic("crawler", "nope"), want: http.StatusProxyAuthRequired},
		{name: "wrong user", user: "other", pass: "s3cret", authz: basic("other", "s3cret"), want: http.StatusProxyAuthRequired},
		{name: "not basic", authz: "Bearer s3cret", want: http.StatusProxyAuthRequired},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := proxy
			if tc.user != "" {
				p = withUser(proxy, tc.user, tc.pass)
			}
			req, _ := http.NewRequest(http.MethodGet, origin.URL+"/a", nil)
			if tc.authz != "" && tc.user == "" {
				req.Header.Set("Proxy-Authorization", tc.authz)
			}
			resp, err := client(p, nil).Do(req)
			if err != nil {
				t.Fatalf("GET: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("GET status %d, want %d", resp.StatusCode, tc.want)
			}
			if tc.want == http.StatusOK && resp.Header.Get("X-Saw-Proxy-Auth") != "" {
				t.Errorf("origin saw Proxy-Authorization; it must be stripped")
			}
			if tc.want == http.StatusProxyAuthRequired && resp.Header.Get("Proxy-Authenticate") == "" {
				t.Errorf("407 without Proxy-Authenticate")
			}
			if got := rawConnect(t, proxy, target, tc.authz); got != tc.want {
				t.Errorf("CONNECT status %d, want %d", got, tc.want)
			}
		})
	}
}

func TestSourceAddress(t *testing.T) {
	origin := echoOrigin(t)
	proxy := startProxy(t, Config{SourceAddr: net.ParseIP("127.0.0.2"), Egress: allow(t, origin.URL)})
	resp, err := client(proxy, nil).Get(origin.URL + "/")
	if err != nil {
		t.Fatalf("GET: %v", err)
	}
	resp.Body.Close()
	if got := resp.Header.Get("X-Remote"); got != "127.0.0.2" {
		t.Fatalf("origin saw client %q, want 127.0.0.2", got)
	}
}

func TestRejectsOriginForm(t *testing.T) {
	proxy := startProxy(t, Config{})
	resp, err := http.Get(proxy.String() + "/not-a-proxy-request")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("status %d, want 400", resp.StatusCode)
	}
}

func TestUnreachableOriginIs502(t *testing.T) {
	dead := testnet.Refusing(t).String()
	proxy := startProxy(t, Config{Egress: allow(t, dead)})
	resp, err := client(proxy, nil).Get("http://" + dead + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", resp.StatusCode)
	}
	// The gateway retries on another proxy only a failure the proxy marks
	// as its own.
	if got := resp.Header.Get(events.ProxyErrorHeader); got != "origin unreachable" {
		t.Errorf("%s: %q, want %q", events.ProxyErrorHeader, got, "origin unreachable")
	}
	if got := rawConnect(t, proxy, dead, ""); got != http.StatusBadGateway {
		t.Fatalf("CONNECT status %d, want 502", got)
	}
}

func TestReadAuthFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", string(FormatAuth(Credentials{Username: "u", Password: "p:w"})), 0o600)
	c, err := ReadAuthFile(good)
	if err != nil || c.Username != "u" || c.Password != "p:w" {
		t.Fatalf("ReadAuthFile = %+v, %v; want u / p:w", c, err)
	}
	for _, tc := range []struct {
		name, content string
		mode          os.FileMode
	}{
		{"open", "u:p\n", 0o644},
		{"no colon", "up\n", 0o600},
		{"two lines", "u:p\nx:y\n", 0o600},
		{"no user", ":p\n", 0o600},
	} {
		if _, err := ReadAuthFile(write(tc.name, tc.content, tc.mode)); !errors.Is(err, ErrBadAuthFile) {
			t.Errorf("%s: err %v, want ErrBadAuthFile", tc.name, err)
		}
	}
}

// TestClientHeadersNotForwarded: the headers that name the client or the
// proxies before this one (Forwarded, Via, X-Forwarded-*) never reach the
// origin, whoever set them.
func TestClientHeadersNotForwarded(t *testing.T) {
	seen := make(chan http.Header, 1)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(origin.Close)
	proxy := startProxy(t, Config{Egress: allow(t, origin.URL)})
	req, err := http.NewRequest(http.MethodGet, origin.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Forwarded", "for=10.9.8.7;by=crawler")
	req.Header.Set("Via", "1.1 crawler-internal")
	req.Header.Set("X-Forwarded-For", "10.9.8.7")
	req.Header.Set("X-Forwarded-Host", "crawler.internal")
	req.Header.Set("X-Forwarded-Proto", "https")
	req.Header.Set("X-Kept", "yes")
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy)}, Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	got := <-seen
	for _, h := range egress.ClientHeaders {
		if v := got.Values(h); len(v) > 0 {
			t.Errorf("the origin saw %s: %q", h, v)
		}
	}
	if got.Get("X-Kept") != "yes" {
		t.Errorf("the origin saw %v; other headers must pass", got)
	}
}
