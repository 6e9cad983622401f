//go:build integration

package integration

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/kvm"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// stallDialer's connections can be made to stop delivering what libvirtd
// sends, as a host that hangs would.
type stallDialer struct {
	libvirt.Dialer
	mu    sync.Mutex
	gate  chan struct{} // closed while not stalled
	dials int
}

func newStallDialer(d libvirt.Dialer) *stallDialer {
	g := make(chan struct{})
	close(g)
	return &stallDialer{Dialer: d, gate: g}
}

func (s *stallDialer) Dial(ctx context.Context) (net.Conn, error) {
	c, err := s.Dialer.Dial(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.dials++
	s.mu.Unlock()
	return &stallConn{Conn: c, s: s, closed: make(chan struct{})}, nil
}

func (s *stallDialer) stall() {
	s.mu.Lock()
	s.gate = make(chan struct{})
	s.mu.Unlock()
}

func (s *stallDialer) resume() {
	s.mu.Lock()
	close(s.gate)
	s.mu.Unlock()
}

func (s *stallDialer) dialled() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dials
}

type stallConn struct {
	net.Conn
	s      *stallDialer
	closed chan struct{}
	once   sync.Once
}

func (c *stallConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.s.mu.Lock()
	g := c.s.gate
	c.s.mu.Unlock()
	select {
	case <-g:
	case <-c.closed:
		return 0, net.ErrClosed
	}
	return n, err
}

func (c *stallConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// TestTimedOutCheckKeepsTheSharedConnection: a check that times out
// abandons its RPC and leaves the shared connection to other work, while a
// timed-out work call kills it and the next call dials again.
func TestTimedOutCheckKeepsTheSharedConnection(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	entry := randomEntry(t)
	var sd *stallDialer
	stack := kvm.Open(testConfig(t, entry, socket, pool, network, "http://127.0.0.1:1/unused"), kvm.Options{Dialer: func(d libvirt.Dialer) libvirt.Dialer {
		sd = newStallDialer(d)
		return sd
	}})
	defer stack.Close()
	ctx := context.Background()
	if _, err := stack.Driver.List(ctx); err != nil {
		t.Fatalf("List: %v", err)
	}
	if n := sd.dialled(); n != 1 {
		t.Fatalf("dials = %d, want 1", n)
	}

	sd.stall()
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	v := stack.Driver.Check(cctx)
	cancel()
	if len(v) == 0 || v[0].OK {
		t.Fatalf("Check on a stalled host = %+v, want a failed libvirt verdict", v)
	}
	// While the abandoned call is outstanding, the next check fails at once.
	v = stack.Driver.Check(ctx)
	if len(v) == 0 || v[0].OK || !strings.Contains(v[0].Detail, "has not returned yet") {
		t.Errorf("second Check = %+v, want an immediate 'has not returned yet'", v)
	}
	sd.resume()
	if _, err := stack.Driver.List(ctx); err != nil {
		t.Fatalf("List after the stall: %v", err)
	}
	if n := sd.dialled(); n != 1 {
		t.Errorf("dials after a timed-out check = %d, want 1 (the shared connection kept)", n)
	}
	eventually(t, "the abandoned check call to return", 10*time.Second, func() bool {
		v := stack.Driver.Check(ctx)
		return len(v) == 4 && v[0].OK
	})

	// A work call that times out kills the connection; the next one redials.
	sd.stall()
	cctx, cancel = context.WithTimeout(ctx, time.Second)
	_, err := stack.Driver.List(cctx)
	cancel()
	if !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("List on a stalled host = %v, want transient", err)
	}
	sd.resume()
	if _, err := stack.Driver.List(ctx); err != nil {
		t.Fatalf("List after the kill: %v", err)
	}
	if n := sd.dialled(); n != 2 {
		t.Errorf("dials after a timed-out work call = %d, want 2 (killed and redialled)", n)
	}
}
