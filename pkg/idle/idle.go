// Package idle bounds how long a proxy's client connections may stand
// still: a request body that stops arriving ([Body]) and a tunnel that
// carries nothing either way ([Tunnel]). Both work by deadlines on the
// connections, so a tunnel between two TCP connections keeps the
// kernel's splice(2) path.
package idle

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// ErrBodyStalled is the error of a request body's Read when no byte of it
// arrived for the body timeout: the client stalled, no upstream failed.
var ErrBodyStalled = errors.New("the client sent no byte of the request body for the body timeout")

// Body returns r's body bounded by d: each Read fails with
// [ErrBodyStalled] when the client sends nothing for d. It sets the read
// deadline of r's connection through w, and clears it when the body ends
// or is closed, so the server's own deadlines apply again (a deadline
// left behind would cut the response that follows). A request without
// body, or d <= 0, keeps its body as it is.
func Body(w http.ResponseWriter, r *http.Request, d time.Duration) io.ReadCloser {
	if d <= 0 || r.Body == nil || r.Body == http.NoBody {
		return r.Body
	}
	return &body{rc: http.NewResponseController(w), body: r.Body, d: d}
}

// Stalled reports whether rc is a body from [Body] that stalled. A
// caller whose upstream request failed asks it: the stall also ends the
// request's context, and which of the two errors an upstream call
// reports is a race.
func Stalled(rc io.ReadCloser) bool {
	b, ok := rc.(*body)
	if !ok {
		return false
	}
	if b.stalled.Load() {
		return true
	}
	// A Read may still be on its way back from the deadline that ended
	// the context.
	d := b.readUntil.Load()
	return d != 0 && time.Now().UnixNano() >= d
}

type body struct {
	rc      *http.ResponseController
	body    io.ReadCloser
	d       time.Duration
	done    atomic.Bool
	stalled atomic.Bool
	// readUntil is the deadline of the Read under way (unix nanoseconds),
	// 0 between Reads.
	readUntil atomic.Int64
}

func (b *body) Read(p []byte) (int, error) {
	if b.done.Load() {
		return b.body.Read(p)
	}
	until := time.Now().Add(b.d)
	if err := b.rc.SetReadDeadline(until); err != nil {
		// The connection takes no deadline (not a net.Conn): unbounded.
		b.done.Store(true)
		return b.body.Read(p)
	}
	b.readUntil.Store(until.UnixNano())
	n, err := b.body.Read(p)
	b.readUntil.Store(0)
	switch {
	case err == nil:
	case errors.Is(err, os.ErrDeadlineExceeded):
		b.stalled.Store(true)
		b.done.Store(true)
		return n, ErrBodyStalled
	default:
		b.clear()
	}
	return n, err
}

func (b *body) Close() error {
	b.clear()
	return b.body.Close()
}

// clear ends the body's deadline (once).
func (b *body) clear() {
	if !b.done.Swap(true) {
		_ = b.rc.SetReadDeadline(time.Time{})
	}
}

// Tunnel copies both ways between a and b until either side ends (or,
// with halfClose, until both have: a side's EOF half-closes the other
// side's writing and the reverse direction keeps flowing), or until the
// tunnel carried no byte either way for d; then it closes both. It
// returns the bytes copied each way and whether the idle bound ended it.
// d <= 0 leaves the tunnel unbounded.
//
// A tunnel carrying a byte at least every d stays open; an idle one
// closes between d and about 5/4 d after its last byte. A direction
// whose writing is blocked (its reader stopped reading) for about d
// counts as idle too.
func Tunnel(a, b net.Conn, d time.Duration, halfClose bool) (aToB, bToA int64, timedOut bool) {
	t := &tunnel{d: d, period: d / 4}
	start := time.Now().UnixNano()
	t.moved[0].Store(start)
	t.moved[1].Store(start)
	var once sync.Once
	closeBoth := func() {
		once.Do(func() {
			_ = a.Close()
			_ = b.Close()
		})
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		aToB = t.copy(0, b, a, halfClose, closeBoth)
	}()
	bToA = t.copy(1, a, b, halfClose, closeBoth)
	wg.Wait()
	closeBoth()
	return aToB, bToA, t.timedOut.Load()
}

type tunnel struct {
	d, period time.Duration
	// moved holds, per direction, when it last reported bytes copied
	// (unix nanoseconds).
	moved    [2]atomic.Int64
	timedOut atomic.Bool
}

// copy copies src to dst as direction i; it re-arms src's read deadline
// every period and, when a period passes without a byte in direction i,
// ends the tunnel if neither direction reported a byte for d.
func (t *tunnel) copy(i int, dst, src net.Conn, halfClose bool, closeBoth func()) int64 {
	var total int64
	for {
		if t.d > 0 {
			_ = src.SetReadDeadline(time.Now().Add(t.period))
		}
		n, err := io.Copy(dst, src)
		total += n
		now := time.Now()
		if n > 0 {
			t.moved[i].Store(now.UnixNano())
		}
		if err != nil && t.d > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			idleSince := now.Add(-t.d).UnixNano()
			if t.moved[0].Load() > idleSince || t.moved[1].Load() > idleSince {
				continue
			}
			t.timedOut.Store(true)
			closeBoth()
			return total
		}
		if err == nil && halfClose {
			if cw, ok := dst.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
				// This direction is done: it carries nothing more, so
				// only the other one's bytes keep the tunnel open.
				t.moved[i].Store(0)
				return total
			}
		}
		closeBoth()
		return total
	}
}
