package bus_test

import (
	"bytes"
	"net"
	"sync"
	"testing"
	"time"
)

// pullRequest starts the subject of a JetStream pull request, as a client
// publishes it.
var pullRequest = []byte("$JS.API.CONSUMER.MSG.NEXT.")

// relay forwards TCP connections from its loopback listener to a target,
// both ways, and can hold what the server sends for a while from a client's
// pull request on: the server has the request, and its answer is late, as
// on a congested network or from a busy server.
type relay struct {
	ln     net.Listener
	target string

	// toClient is held shared by every write to the client and exclusively
	// by a stall.
	toClient sync.RWMutex

	mu     sync.Mutex
	armed  time.Duration // stall after the next pull request, when > 0
	stalls int
	conns  []net.Conn
	closed bool
	wg     sync.WaitGroup
}

// startRelay listens on a kernel-chosen loopback port and forwards to
// target until the test ends.
func startRelay(t testing.TB, target string) *relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("relay listen: %v", err)
	}
	r := &relay{ln: ln, target: target}
	r.wg.Go(r.accept)
	t.Cleanup(r.close)
	return r
}

// URL is the NATS URL that reaches the target through the relay.
func (r *relay) URL() string { return "nats://" + r.ln.Addr().String() }

// StallAfterNextPull holds every byte from the server for d from the next
// pull request on: none of the answer reaches the client before d is over.
func (r *relay) StallAfterNextPull(d time.Duration) {
	r.mu.Lock()
	r.armed = d
	r.mu.Unlock()
}

// Stalls is how many stalls happened.
func (r *relay) Stalls() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stalls
}

func (r *relay) accept() {
	for {
		in, err := r.ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", r.target)
		if err != nil {
			in.Close()
			continue
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			in.Close()
			out.Close()
			return
		}
		r.conns = append(r.conns, in, out)
		r.mu.Unlock()
		r.wg.Go(func() { r.pipe(out, in, true) })
		r.wg.Go(func() { r.pipe(in, out, false) })
	}
}

// pipe copies src to dst. From the client (fromClient), it watches for
// pull requests, across read boundaries, and starts an armed stall before
// forwarding one, so that no byte of the answer slips through.
func (r *relay) pipe(dst, src net.Conn, fromClient bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	var tail []byte
	for {
		n, err := src.Read(buf)
		if n > 0 {
			var werr error
			if fromClient {
				window := append(tail, buf[:n]...)
				if bytes.Contains(window, pullRequest) {
					r.stallIfArmed()
				}
				tail = append(tail[:0], window[max(0, len(window)-len(pullRequest)+1):]...)
				_, werr = dst.Write(buf[:n])
			} else {
				r.toClient.RLock()
				_, werr = dst.Write(buf[:n])
				r.toClient.RUnlock()
			}
			if werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (r *relay) stallIfArmed() {
	r.mu.Lock()
	d := r.armed
	r.armed = 0
	if d > 0 {
		r.stalls++
	}
	r.mu.Unlock()
	if d > 0 {
		r.toClient.Lock()
		time.AfterFunc(d, r.toClient.Unlock)
	}
}

func (r *relay) close() {
	r.ln.Close()
	r.mu.Lock()
	r.closed = true
	for _, c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}
