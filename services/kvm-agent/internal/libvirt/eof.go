package libvirt

import (
	"io"
	"sync"
	"sync/atomic"
)

// eofReader ends a stream with io.EOF whatever error its source returns,
// and keeps that error. go-libvirt's stream sender parks forever on an
// unbuffered channel when the source fails mid-stream (both its goroutines
// block on channel sends, so killing the socket does not free them); an EOF
// is the one outcome that finishes the stream the normal way. The caller
// reads the real error from Err and compares the length it expected.
type eofReader struct {
	r   io.Reader
	mu  sync.Mutex
	err error
}

func (e *eofReader) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err != nil && err != io.EOF {
		e.mu.Lock()
		if e.err == nil {
			e.err = err
		}
		e.mu.Unlock()
		return n, io.EOF
	}
	return n, err
}

// Err is the first non-EOF error of the source.
func (e *eofReader) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n atomic.Uint64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(uint64(n))
	return n, err
}

// gateReader stops reading its source once closed. go-libvirt's stream
// sender may still be running when a failed upload returns; after close it
// gets EOF instead of touching the caller's reader (at most a read already
// in flight completes).
type gateReader struct {
	r      io.Reader
	closed atomic.Bool
}

func (g *gateReader) Read(p []byte) (int, error) {
	if g.closed.Load() {
		return 0, io.EOF
	}
	return g.r.Read(p)
}

func (g *gateReader) close() { g.closed.Store(true) }

// chunkReader caps each read at size bytes, which sets the size of the
// stream packets go-libvirt sends (it reads into a 4 MiB buffer).
type chunkReader struct {
	r    io.Reader
	size int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(p) > c.size {
		p = p[:c.size]
	}
	return c.r.Read(p)
}
