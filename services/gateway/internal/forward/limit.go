package forward

import (
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// refuseWithin bounds the answer to a connection over its client's limit.
const refuseWithin = time.Second

// LimitListener returns ln bounded to max open connections per client
// address (IP): a connection past it is answered at once with 429 Too
// Many Requests and closed, unread. A connection counts from its accept
// to its Close, including the tunnel it may carry. max <= 0: unbounded.
func LimitListener(ln net.Listener, max int) net.Listener {
	if max <= 0 {
		return ln
	}
	return &limitListener{Listener: ln, max: max, open: map[string]int{}}
}

type limitListener struct {
	net.Listener
	max int

	mu   sync.Mutex
	open map[string]int
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		host := clientHost(c.RemoteAddr().String())
		l.mu.Lock()
		over := l.open[host] >= l.max
		if !over {
			l.open[host]++
		}
		l.mu.Unlock()
		if over {
			go l.refuse(c, host)
			continue
		}
		var once sync.Once
		release := func() {
			once.Do(func() {
				l.mu.Lock()
				defer l.mu.Unlock()
				if l.open[host]--; l.open[host] <= 0 {
					delete(l.open, host)
				}
			})
		}
		// A TCP connection stays a *net.TCPConn inside, so a tunnel's
		// bytes keep the kernel's splice path.
		if tc, ok := c.(*net.TCPConn); ok {
			return &limitedTCP{TCPConn: tc, release: release}, nil
		}
		return &limitedConn{Conn: c, release: release}, nil
	}
}

// refuse answers a connection past its client's limit and closes it,
// after reading (briefly) what the client sent, so the close does not
// reset the answer away.
func (l *limitListener) refuse(c net.Conn, host string) {
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(refuseWithin))
	body := fmt.Sprintf("proxyfleet gateway: %s has %d connections open, the most one client address may (--max-conns-per-client); reuse them or close some\n", host, l.max)
	_, err := fmt.Fprintf(c, "HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err != nil {
		return
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
}

type limitedTCP struct {
	*net.TCPConn
	release func()
}

func (c *limitedTCP) Close() error {
	c.release()
	return c.TCPConn.Close()
}

type limitedConn struct {
	net.Conn
	release func()
}

func (c *limitedConn) Close() error {
	c.release()
	return c.Conn.Close()
}
