package probe_test

import (
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fwdProxy is a small forward proxy for tests: plain HTTP with absolute
// URLs and CONNECT, optional basic auth, dialling out from a chosen source
// address so the echo endpoint sees it as the egress IP.
type fwdProxy struct {
	t      *testing.T
	source string // outbound source IP; guarded by mu
	user   string
	pass   string

	addr     string
	mu       sync.Mutex
	srv      *http.Server
	conns    map[net.Conn]bool
	wg       sync.WaitGroup
	served   atomic.Int64
	rejected atomic.Int64
	hosts    map[string]int // requests by the host they asked for; guarded by mu
}

func newFwdProxy(t *testing.T, source, user, pass string) *fwdProxy {
	t.Helper()
	p := &fwdProxy{t: t, source: source, user: user, pass: pass, addr: "127.0.0.1:0", conns: map[net.Conn]bool{}}
	p.start()
	t.Cleanup(p.stop)
	return p
}

// start listens on p.addr (the same port again after a stop).
func (p *fwdProxy) start() {
	p.t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatalf("forward proxy listen %s: %v", p.addr, err)
	}
	p.addr = ln.Addr().String()
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 5 * time.Second}
	p.mu.Lock()
	p.srv = srv
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		_ = srv.Serve(ln)
	}()
}

// stop closes the listener and every connection, tunnels included.
func (p *fwdProxy) stop() {
	p.mu.Lock()
	srv := p.srv
	p.srv = nil
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
	p.wg.Wait()
}

func (p *fwdProxy) track(c net.Conn, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if on {
		p.conns[c] = true
	} else {
		delete(p.conns, c)
	}
}

func (p *fwdProxy) dialer() *net.Dialer {
	p.mu.Lock()
	source := p.source
	p.mu.Unlock()
	return &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(source)}}
}

// setSource changes the address the proxy dials out from. A request still
// being served after a stop (srv.Close does not wait for handlers) may
// read it meanwhile.
func (p *fwdProxy) setSource(source string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.source = source
}

// setPass changes the password the proxy demands.
func (p *fwdProxy) setPass(pass string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pass = pass
}

func (p *fwdProxy) authorized(r *http.Request) bool {
	if p.user == "" {
		return true
	}
	p.mu.Lock()
	want := p.user + ":" + p.pass
	p.mu.Unlock()
	h := r.Header.Get("Proxy-Authorization")
	raw, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(h, "Basic "))
	return strings.HasPrefix(h, "Basic ") && err == nil && string(raw) == want
}

// requestsFor counts the requests for host (a CONNECT's target, or the host
// of a plain request's URL) the proxy received.
func (p *fwdProxy) requestsFor(host string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hosts[host]
}

func (p *fwdProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.hosts == nil {
		p.hosts = map[string]int{}
	}
	p.hosts[r.Host]++
	p.mu.Unlock()
	if !p.authorized(r) {
		p.rejected.Add(1)
		w.Header().Set("Proxy-Authenticate", `Basic realm="test"`)
		http.Error(w, "proxy authentication required", http.StatusProxyAuthRequired)
		return
	}
	if r.Method == http.MethodConnect {
		p.tunnel(w, r)
		return
	}
	if !r.URL.IsAbs() {
		http.Error(w, "absolute URL required", http.StatusBadRequest)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Header.Del("Proxy-Authorization")
	tr := &http.Transport{DialContext: p.dialer().DialContext, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	relay(w, resp)
	p.served.Add(1)
}

// relay passes an origin's answer on to the client: resp's headers,
// status and body, and closes the body.
func relay(w http.ResponseWriter, resp *http.Response) {
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

func (p *fwdProxy) tunnel(w http.ResponseWriter, r *http.Request) {
	up, err := p.dialer().DialContext(r.Context(), "tcp", r.Host)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		_ = up.Close()
		http.Error(w, "no hijack", http.StatusInternalServerError)
		return
	}
	down, _, err := hj.Hijack()
	if err != nil {
		_ = up.Close()
		return
	}
	p.track(down, true)
	p.track(up, true)
	defer func() {
		p.track(down, false)
		p.track(up, false)
		_ = down.Close()
		_ = up.Close()
	}()
	if _, err := io.WriteString(down, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	p.served.Add(1)
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, down); done <- struct{}{} }()
	go func() { _, _ = io.Copy(down, up); done <- struct{}{} }()
	<-done
	_ = down.Close()
	_ = up.Close()
	<-done
}
