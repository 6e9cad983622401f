package forward

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// transportKey names a transport: the proxy it dials and the credentials
// it sends (user "" for none).
type transportKey struct {
	address, user, password string
}

// transports holds one transport per proxy: its Proxy function is a
// constant URL, so a request carries no proxy in its context, and each
// keeps the proxy's idle connections. A proxy whose address or
// credentials change gets a new one; the old one's idle connections are
// closed.
type transports struct {
	mu sync.RWMutex
	m  map[transportKey]*proxyTransport
}

type proxyTransport struct {
	id string
	t  *http.Transport
}

// get returns the transport of proxy id for key, made by create the first
// time.
func (ts *transports) get(id string, key transportKey, create func(key transportKey) *http.Transport) *http.Transport {
	ts.mu.RLock()
	pt := ts.m[key]
	ts.mu.RUnlock()
	if pt != nil {
		return pt.t
	}
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if pt := ts.m[key]; pt != nil {
		return pt.t
	}
	if ts.m == nil {
		ts.m = make(map[transportKey]*proxyTransport)
	}
	// The proxy's earlier address or credentials are no longer used.
	ts.dropLocked(id)
	pt = &proxyTransport{id: id, t: create(key)}
	ts.m[key] = pt
	return pt.t
}

// forget drops the transports of proxy id and closes their idle
// connections; requests they carry finish.
func (ts *transports) forget(id string) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.dropLocked(id)
}

func (ts *transports) dropLocked(id string) {
	for k, pt := range ts.m {
		if pt.id == id {
			delete(ts.m, k)
			pt.t.CloseIdleConnections()
		}
	}
}

// closeIdle closes every transport's idle connections.
func (ts *transports) closeIdle() {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	for _, pt := range ts.m {
		pt.t.CloseIdleConnections()
	}
}

// len returns how many transports are held.
func (ts *transports) len() int {
	ts.mu.RLock()
	defer ts.mu.RUnlock()
	return len(ts.m)
}

// newTransport returns the transport of the proxy key names.
func (s *Server) newTransport(key transportKey) *http.Transport {
	u := &url.URL{Scheme: "http", Host: key.address}
	if key.user != "" {
		u.User = url.UserPassword(key.user, key.password)
	}
	return &http.Transport{
		Proxy:       http.ProxyURL(u),
		DialContext: s.dial,
		OnProxyConnectResponse: func(ctx context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
			if a, ok := ctx.Value(connectKey{}).(*connectAnswer); ok {
				a.set(resp)
			}
			return nil
		},
		// HTTP/1.1 to origins (no ForceAttemptHTTP2), verified against
		// the system's roots and --origin-ca.
		TLSClientConfig:       &tls.Config{RootCAs: s.cfg.OriginRoots, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout:   s.cfg.ResponseTimeout,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: s.cfg.ResponseTimeout,
		DisableCompression:    true,
	}
}
