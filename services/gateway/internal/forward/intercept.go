package forward

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"proxyfleet/services/gateway/internal/intercept"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

// CA gives the certificates the gateway presents to the clients of
// intercepting pools (package fleet's Fleet, which loads the fleet's
// gateway CA).
type CA interface {
	// Issuer returns the issuer of leaf certificates, or why this
	// gateway cannot intercept now (the CA not loaded, or sealed to
	// another key).
	Issuer() (*intercept.Issuer, error)
}

// Bounds of an intercepted connection.
const (
	// interceptMaxHeader bounds a request's header inside an
	// intercepted connection; past it the request is answered 431.
	interceptMaxHeader = 1 << 20
	// interceptHeaderTimeout bounds the wait for a request's header
	// once its first byte arrived.
	interceptHeaderTimeout = 30 * time.Second
)

// discardLog drops net/http's own log lines of intercepted connections
// (a client that hung up, a malformed request): they would quote what
// clients sent.
var discardLog = log.New(io.Discard, "", 0)

// intercepts reports whether target's pool has the gateway terminate its
// clients' tunnels (gateway.intercept).
func (s *Server) intercepts(pool string) bool {
	spec := s.cfg.Table.Spec(pool)
	return spec != nil && spec.Intercept
}

// intercept answers a CONNECT of an intercepting pool itself: it says
// 200, terminates the client's TLS with a leaf of the gateway CA for the
// name the client verifies (its SNI, or the CONNECT host when it sends
// none), offers HTTP/1.1 only, and serves the requests inside, each one as
// a plain HTTP request to https://<CONNECT host> through [Server.relay]
// with target: per-request routing, sessions, ban rules, retries and
// stats apply as to plain HTTP. It returns once the handshake is done,
// handing the connection to the server of intercepted connections.
func (s *Server) intercept(w http.ResponseWriter, r *http.Request, target route.Target) {
	start := time.Now()
	iss, err := s.issuer()
	if err != nil {
		s.fail(target.Pool, "", "no_ca", start)
		http.Error(w, "proxyfleet gateway: pool "+target.Pool+" intercepts HTTPS (gateway.intercept) and this gateway cannot: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	hostname, port, _ := net.SplitHostPort(r.Host)
	urlHost := net.JoinHostPort(hostname, port)
	if port == "443" {
		urlHost = hostname
		if ip := net.ParseIP(hostname); ip != nil && ip.To4() == nil {
			urlHost = "[" + hostname + "]"
		}
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		http.Error(w, "proxyfleet gateway: this connection cannot carry a tunnel", http.StatusInternalServerError)
		return
	}
	// What the client sent past its CONNECT is the start of its
	// ClientHello; the buffer is dropped when there is none, to hold less
	// per connection.
	var raw net.Conn = conn
	if brw.Reader.Buffered() > 0 {
		raw = &bufferedConn{Conn: conn, r: brw.Reader}
	}
	if _, err := io.WriteString(conn, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		_ = conn.Close()
		return
	}
	tc := tls.Server(raw, &tls.Config{
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			name := hello.ServerName
			if name == "" {
				name = hostname
			}
			return iss.Certificate(name)
		},
		// HTTP/1.1 only: the requests inside go through relay one by
		// one, as plain HTTP does.
		NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12,
	})
	// A client that sends no ClientHello, or stalls in the handshake,
	// holds the connection no longer than a proxy may take to answer.
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DialTimeout)
	err = tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		_ = tc.Close()
		s.fail(target.Pool, "", "client_tls", start)
		s.cfg.Log.Debug("an intercepted client's TLS handshake failed (does it trust the gateway CA?)", "pool", target.Pool, "client", target.Client, "err", err)
		return
	}
	// The CONNECT's record says the tunnel opened; each request inside
	// has a record of its own (serveIntercepted).
	reqlog.Tunneled(w, 0, 0)
	l, ok := s.intercepted.listener(s.newInterceptServer)
	if !ok || !l.hand(&interceptedConn{Conn: tc, target: target, host: urlHost}) {
		_ = tc.Close() // the gateway is stopping
	}
}

// newInterceptServer returns the server of the requests inside every
// intercepted connection.
func (s *Server) newInterceptServer() *http.Server {
	return &http.Server{
		Handler:           http.HandlerFunc(s.serveIntercepted),
		ReadHeaderTimeout: interceptHeaderTimeout,
		MaxHeaderBytes:    interceptMaxHeader,
		IdleTimeout:       s.cfg.TunnelIdleTimeout,
		ErrorLog:          discardLog,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, interceptedKey{}, c)
		},
	}
}

// serveIntercepted relays one request of an intercepted connection to
// https://<CONNECT host> with the CONNECT's target. The request counts as
// one open connection of the pool while it is carried: an idle
// intercepted connection holds no proxy.
func (s *Server) serveIntercepted(w http.ResponseWriter, r *http.Request) {
	ic, ok := r.Context().Value(interceptedKey{}).(*interceptedConn)
	if !ok {
		http.Error(w, "proxyfleet gateway: not an intercepted connection", http.StatusInternalServerError)
		return
	}
	if r.Method == http.MethodConnect {
		http.Error(w, "proxyfleet gateway: CONNECT inside an intercepted tunnel is not carried", http.StatusMethodNotAllowed)
		return
	}
	ps := s.stats.pool(ic.target.Pool)
	ps.begin()
	defer ps.end()
	r.URL.Scheme = "https"
	r.URL.Host = ic.host
	rec, w, r := s.cfg.RequestLog.Start(w, r)
	rec.Target(ic.target.Pool, ic.target.Session)
	defer s.cfg.RequestLog.Finish(rec)
	s.relay(w, r, ic.target)
}

func (s *Server) issuer() (*intercept.Issuer, error) {
	if s.cfg.CA == nil {
		return nil, errors.New("it has no gateway CA")
	}
	return s.cfg.CA.Issuer()
}

// originCertError returns why an origin's certificate failed
// verification when err is that failure, else nil: the origin's doing,
// not the proxy's.
func originCertError(err error) error {
	if v, ok := errors.AsType[*tls.CertificateVerificationError](err); ok {
		return v.Err
	}
	if v, ok := errors.AsType[x509.HostnameError](err); ok {
		return v
	}
	if v, ok := errors.AsType[x509.CertificateInvalidError](err); ok {
		return v
	}
	if v, ok := errors.AsType[x509.UnknownAuthorityError](err); ok {
		return v
	}
	return nil
}

// OriginRoots returns the certificates origins' certificates are verified
// against: the system's roots plus the PEM bundle in file ("": none). A
// file that cannot be read or holds no PEM certificate is an error.
func OriginRoots(file string) (*x509.CertPool, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if file == "" {
		return pool, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("origin CA bundle: %w", err)
	}
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("origin CA bundle %s holds no PEM certificate; give a file of -----BEGIN CERTIFICATE----- blocks", file)
	}
	return pool, nil
}

// bufferedConn is a connection whose first bytes were read into r.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// interceptedKey is the context key of a request's [interceptedConn].
type interceptedKey struct{}

// interceptedConn is a client's connection once its TLS is terminated,
// with what its CONNECT said: the target (pool, session, client) and the
// host of the URLs of its requests.
type interceptedConn struct {
	net.Conn // a *tls.Conn, handshake done
	target   route.Target
	host     string
}

// interceptServer is a [Server]'s one http.Server of intercepted
// connections, started with the first: intercept hands it each
// connection once its handshake is done and returns, so an idle
// intercepted connection holds one goroutine and net/http's buffers of
// it, no more.
type interceptServer struct {
	mu     sync.Mutex
	l      *chanListener
	srv    *http.Server
	closed bool
}

// listener returns the listener of the server newServer makes, starting
// it the first time; ok is false once the server was closed.
func (is *interceptServer) listener(newServer func() *http.Server) (l *chanListener, ok bool) {
	is.mu.Lock()
	defer is.mu.Unlock()
	if is.closed {
		return nil, false
	}
	if is.l == nil {
		is.l = &chanListener{conns: make(chan net.Conn), done: make(chan struct{})}
		is.srv = newServer()
		go func() { _ = is.srv.Serve(is.l) }()
	}
	return is.l, true
}

// close stops the server and closes every intercepted connection.
func (is *interceptServer) close() {
	is.mu.Lock()
	defer is.mu.Unlock()
	is.closed = true
	if is.srv != nil {
		_ = is.srv.Close()
	}
}

// chanListener is a listener whose connections are handed to it.
type chanListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

// hand gives c to the server; false when the listener is closed.
func (l *chanListener) hand(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return interceptAddr{} }

// interceptAddr is the address of the listener of intercepted
// connections, which listens nowhere.
type interceptAddr struct{}

func (interceptAddr) Network() string { return "intercepted" }
func (interceptAddr) String() string  { return "intercepted" }
