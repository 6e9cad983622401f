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
// stats apply as to plain HTTP. It returns when the client's connection
// ends.
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
	l := &oneConnListener{conn: tc, addr: tc.LocalAddr(), done: make(chan struct{})}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.serveIntercepted(w, r, target, urlHost)
		}),
		ReadHeaderTimeout: interceptHeaderTimeout,
		MaxHeaderBytes:    interceptMaxHeader,
		IdleTimeout:       s.cfg.TunnelIdleTimeout,
		ErrorLog:          discardLog,
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateClosed || st == http.StateHijacked {
				l.close()
			}
		},
	}
	_ = srv.Serve(l)
}

// serveIntercepted relays one request of an intercepted connection to
// https://host.
func (s *Server) serveIntercepted(w http.ResponseWriter, r *http.Request, target route.Target, host string) {
	if r.Method == http.MethodConnect {
		http.Error(w, "proxyfleet gateway: CONNECT inside an intercepted tunnel is not carried", http.StatusMethodNotAllowed)
		return
	}
	r.URL.Scheme = "https"
	r.URL.Host = host
	s.relay(w, r, target)
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

// oneConnListener hands an http.Server one connection, then blocks until
// close, so Serve returns once that connection ends.
type oneConnListener struct {
	mu   sync.Mutex
	conn net.Conn
	addr net.Addr
	done chan struct{}
	once sync.Once
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.conn
	l.conn = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConnListener) close() { l.once.Do(func() { close(l.done) }) }

func (l *oneConnListener) Close() error {
	l.close()
	return nil
}

func (l *oneConnListener) Addr() net.Addr { return l.addr }
