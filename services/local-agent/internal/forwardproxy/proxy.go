// Package forwardproxy is the built-in forward HTTP proxy of the local
// backend: it forwards absolute-URI HTTP requests, tunnels CONNECT, demands
// basic credentials when configured, enforces the egress policy (package
// egress) on every destination, and can send its outgoing connections from
// one source address.
package forwardproxy

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/hop"
	"proxyfleet/pkg/idle"
)

// Credentials is the basic-auth pair clients must present.
type Credentials struct {
	Username string
	Password string
}

// Config tunes a [Proxy]. Zero values take the defaults noted.
type Config struct {
	// Auth, when set, is demanded in Proxy-Authorization.
	Auth *Credentials
	// SourceAddr, when set, is the local address of outgoing connections.
	SourceAddr net.IP
	// DialTimeout bounds connecting to an origin (default 15s).
	DialTimeout time.Duration
	// ResponseHeaderTimeout bounds waiting for an origin's response headers
	// (default 60s).
	ResponseHeaderTimeout time.Duration
	// Egress is the destination policy; the zero value is the default.
	Egress egress.Policy
	// Dial opens outgoing connections (default: a net.Dialer with
	// DialTimeout and SourceAddr). It is only ever handed an address the
	// policy accepted, as a literal ip:port.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// Resolve looks a host name up (default: the system resolver).
	Resolve func(ctx context.Context, host string) ([]netip.Addr, error)
	// OwnAddrs lists this host's own addresses, refused as
	// [egress.RuleOwnAddress] (default: every interface's addresses,
	// re-read at most every [OwnAddrsRefresh]).
	OwnAddrs func() ([]netip.Addr, error)
	// BodyTimeout is how long a request body may go without a byte
	// arriving before the request is answered 408 (idle.Body); 0:
	// unbounded.
	BodyTimeout time.Duration
	// TunnelIdleTimeout closes a CONNECT tunnel that carried nothing
	// either way for as long (idle.Tunnel); 0: unbounded.
	TunnelIdleTimeout time.Duration
	// Log receives failures; nil discards them.
	Log *slog.Logger
}

// OwnAddrsRefresh is how long the host's own addresses are cached.
const OwnAddrsRefresh = 10 * time.Second

// bodyKey is the context key of a request's body as [idle.Body] returned
// it.
type bodyKey struct{}

// Realm is the basic-auth realm the proxy announces.
const Realm = "proxyfleet"

// listedKey is the context key of a forwarded request's [hop.Listed].
type listedKey struct{}

// Proxy is an http.Handler that acts as a forward proxy.
type Proxy struct {
	cfg     Config
	forward *httputil.ReverseProxy
	own     ownCache
	// userSum and passSum are SHA-256 digests of the credentials, so the
	// comparison takes the same time whatever their lengths.
	userSum, passSum [32]byte
}

// New returns a proxy for cfg.
func New(cfg Config) *Proxy {
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 15 * time.Second
	}
	if cfg.ResponseHeaderTimeout <= 0 {
		cfg.ResponseHeaderTimeout = 60 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	d := &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second}
	if cfg.SourceAddr != nil {
		d.LocalAddr = &net.TCPAddr{IP: cfg.SourceAddr}
	}
	if cfg.Dial == nil {
		cfg.Dial = d.DialContext
	}
	if cfg.Resolve == nil {
		cfg.Resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	if cfg.OwnAddrs == nil {
		cfg.OwnAddrs = egress.HostAddrs
	}
	p := &Proxy{cfg: cfg}
	p.own.read = cfg.OwnAddrs
	if cfg.Auth != nil {
		p.userSum = sha256.Sum256([]byte(cfg.Auth.Username))
		p.passSum = sha256.Sum256([]byte(cfg.Auth.Password))
	}
	transport := &http.Transport{
		Proxy:                 nil, // never chain to the environment's proxy
		DialContext:           hop.Dialer(p.dialHTTP),
		TLSHandshakeTimeout:   15 * time.Second,
		ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		IdleConnTimeout:       90 * time.Second,
		MaxIdleConnsPerHost:   16,
		DisableCompression:    true, // pass bodies through as the origin sent them
	}
	p.forward = &httputil.ReverseProxy{
		// The incoming absolute URI is already the destination; Rewrite (as
		// opposed to Director) drops the X-Forwarded-* the client sent, and
		// the rest of the headers naming the client go too.
		Rewrite: func(pr *httputil.ProxyRequest) {
			for _, h := range egress.ClientHeaders {
				pr.Out.Header.Del(h)
			}
			ctx, listed := hop.Track(pr.Out.Context())
			pr.Out = pr.Out.WithContext(context.WithValue(ctx, listedKey{}, listed))
		},
		ModifyResponse: func(resp *http.Response) error {
			// ReverseProxy drops the fields the Connection header lists,
			// but Go's client removed a Connection header holding
			// "close" before it could see them.
			if listed, ok := resp.Request.Context().Value(listedKey{}).(*hop.Listed); ok {
				hop.Remove(resp.Header, listed.Fields()...)
			}
			// Only this proxy vouches for a response it made itself: an
			// origin's copy of the marker would have the gateway retry a
			// site's own 502 on every proxy and blame each.
			resp.Header.Del(events.ProxyErrorHeader)
			return nil
		},
		Transport:     transport,
		FlushInterval: -1, // stream: flush after every write
		BufferPool:    &bufferPool{},
		ErrorLog:      nil,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var re *refusal
			if errors.As(err, &re) {
				p.refuse(w, r, re)
				return
			}
			if body, _ := r.Context().Value(bodyKey{}).(io.ReadCloser); idle.Stalled(body) {
				// The client's fault: no origin failed.
				w.Header().Set("Connection", "close")
				http.Error(w, "proxy: the request body stopped arriving", http.StatusRequestTimeout)
				return
			}
			cfg.Log.Warn("forward failed", "host", r.URL.Host, "err", err)
			w.Header().Set(events.ProxyErrorHeader, "origin unreachable")
			http.Error(w, "proxy: origin unreachable", http.StatusBadGateway)
		},
	}
	return p
}

// ServeHTTP authenticates the client, then tunnels CONNECT or forwards an
// absolute-URI request.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !p.authorized(r) {
		w.Header().Set("Proxy-Authenticate", `Basic realm="`+Realm+`"`)
		http.Error(w, "proxy authentication required", http.StatusProxyAuthRequired)
		return
	}
	if r.Method == http.MethodConnect {
		p.tunnel(w, r)
		return
	}
	if !r.URL.IsAbs() || r.URL.Host == "" {
		http.Error(w, "this is a forward proxy: send an absolute URI (http://host/path)", http.StatusBadRequest)
		return
	}
	if r.URL.Scheme != "http" {
		http.Error(w, "only http:// is forwarded; use CONNECT for https", http.StatusBadRequest)
		return
	}
	r.Body = idle.Body(w, r, p.cfg.BodyTimeout)
	// The request the error handler gets carries the body wrapped by
	// ReverseProxy; the context carries it as read.
	p.forward.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), bodyKey{}, r.Body)))
}

// authorized reports whether r carries the configured credentials (always
// true without auth).
func (p *Proxy) authorized(r *http.Request) bool {
	if p.cfg.Auth == nil {
		return true
	}
	user, pass, ok := parseBasic(r.Header.Get("Proxy-Authorization"))
	if !ok {
		return false
	}
	u := sha256.Sum256([]byte(user))
	pw := sha256.Sum256([]byte(pass))
	// Both comparisons always run: no early exit on a wrong user name.
	userOK := subtle.ConstantTimeCompare(u[:], p.userSum[:])
	passOK := subtle.ConstantTimeCompare(pw[:], p.passSum[:])
	return userOK&passOK == 1
}

func parseBasic(h string) (user, pass string, ok bool) {
	const prefix = "basic "
	if len(h) < len(prefix) || !strings.EqualFold(h[:len(prefix)], prefix) {
		return "", "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(h[len(prefix):]))
	if err != nil {
		return "", "", false
	}
	user, pass, ok = strings.Cut(string(raw), ":")
	return user, pass, ok
}

// tunnel answers CONNECT: it dials the authority, reports 200 and copies
// bytes both ways until either side closes.
func (p *Proxy) tunnel(w http.ResponseWriter, r *http.Request) {
	host := r.Host
	if _, _, err := net.SplitHostPort(host); err != nil {
		http.Error(w, "CONNECT needs host:port", http.StatusBadRequest)
		return
	}
	upstream, err := p.dialChecked(r.Context(), host, true)
	var re *refusal
	if errors.As(err, &re) {
		p.refuse(w, r, re)
		return
	}
	if err != nil {
		p.cfg.Log.Warn("connect failed", "host", host, "err", err)
		w.Header().Set(events.ProxyErrorHeader, "origin unreachable")
		http.Error(w, "proxy: origin unreachable", http.StatusBadGateway)
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		upstream.Close()
		http.Error(w, "CONNECT is not supported on this connection", http.StatusInternalServerError)
		return
	}
	client, buf, err := hj.Hijack()
	if err != nil {
		upstream.Close()
		p.cfg.Log.Warn("hijack failed", "err", err)
		return
	}
	// The server's header deadline must not cut a long tunnel.
	_ = client.SetDeadline(time.Time{})
	if _, err := client.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		client.Close()
		upstream.Close()
		return
	}
	if buf != nil && buf.Reader.Buffered() > 0 {
		b, _ := buf.Reader.Peek(buf.Reader.Buffered())
		if _, err := upstream.Write(b); err != nil {
			client.Close()
			upstream.Close()
			return
		}
	}
	// Each side's EOF half-closes the other, so the reverse direction
	// keeps flowing.
	idle.Tunnel(client, upstream, p.cfg.TunnelIdleTimeout, true)
}

// Server returns an http.Server serving p with timeouts suited to a proxy:
// bounded header reads and idle keep-alives; bodies and tunnels are
// bounded by p's own BodyTimeout and TunnelIdleTimeout.
func Server(p *Proxy) *http.Server {
	return &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          nil,
	}
}

// bufferPool reuses the 32 KiB copy buffers of forwarded bodies, which would
// otherwise be allocated once per request.
type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32<<10)
}

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }
