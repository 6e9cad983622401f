// Package testnet hands tests loopback ports the kernel chose and that stay
// reserved while the test runs, so nothing can take them between the choice
// and their use. Asking for a port with a listener and closing it before
// the real user binds (bind-then-close) leaves a window in which another
// process on a busy machine may take it; a socket that is bound but never
// listens holds the port and still refuses every connection. A [Counter]
// is the opposite: a port that accepts, and tells whether anything came.
package testnet

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Refusing returns a loopback address whose port is bound for the rest of
// the test but listens for nothing: a dial to it is refused at once. Use
// it where a test needs an address that is certainly dead.
func Refusing(t testing.TB) *net.TCPAddr {
	t.Helper()
	return reserve(t, false)
}

// Shared returns a loopback address whose port is bound with SO_REUSEPORT for the rest of
// the test, for a child process that binds it with SO_REUSEPORT as well
// (kube-apiserver's --permit-port-sharing). The reservation never listens,
// so every connection reaches the child; only sockets of the same user
// that also ask for SO_REUSEPORT can share the port meanwhile.
func Shared(t testing.TB) *net.TCPAddr {
	t.Helper()
	return reserve(t, true)
}

// Killable returns a loopback listener whose port stays held after the
// listener closes: a test's server "dies" by closing it, and from then on
// a dial to its address is refused at once. A port freed by a plain Close
// goes back to the kernel, which may give it to the next listener on :0
// (another test's server), so a dial meant to fail would reach a stranger
// instead. The port is held by a [Shared] reservation; the listener binds
// it with SO_REUSEPORT.
func Killable(t testing.TB) net.Listener {
	t.Helper()
	addr := reserve(t, true)
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(context.Background(), "tcp", addr.String())
	if err != nil {
		t.Fatalf("testnet: listen on %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

func reserve(t testing.TB, reusePort bool) *net.TCPAddr {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("testnet: socket: %v", err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if reusePort {
		if err := syscall.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			t.Fatalf("testnet: SO_REUSEPORT: %v", err)
		}
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatalf("testnet: bind 127.0.0.1:0: %v", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatalf("testnet: getsockname: %v", err)
	}
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*syscall.SockaddrInet4).Port}
}

// Counter is a listener that accepts every connection, writes its
// greeting (if any) and closes it, counting what it accepted: the target
// a test watches to see that nothing reached it.
type Counter struct {
	net.Listener
	accepted atomic.Int32
}

// Accepted is the number of connections accepted so far.
func (c *Counter) Accepted() int32 { return c.accepted.Load() }

// Count listens on addr (such as "127.0.0.1:0") until the test ends and
// answers each connection with greeting.
func Count(t testing.TB, addr, greeting string) *Counter {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("testnet: listen on %s: %v", addr, err)
	}
	c := &Counter{Listener: ln}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.accepted.Add(1)
			_, _ = io.WriteString(conn, greeting)
			conn.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return c
}

// Serve listens on a loopback port the kernel chose until the test ends,
// calls handle for each connection on a goroutine of its own, and returns
// the address. handle owns the connection and closes it.
func Serve(t testing.TB, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testnet: listen: %v", err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
	return ln.Addr().String()
}

// Echo is a TCP echo on loopback: it sends back what it reads until the
// client closes.
func Echo(t testing.TB) string {
	t.Helper()
	return Serve(t, func(c net.Conn) { _, _ = io.Copy(c, c); _ = c.Close() })
}

// Raw answers every HTTP request on a loopback port with head (status line
// and header fields, CRLF-terminated) and body, then closes, so the test
// controls the exact bytes: as an origin it is a site, as a proxy one that
// relays whatever it got.
func Raw(t testing.TB, head, body string) string {
	t.Helper()
	return Serve(t, func(c net.Conn) {
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		_, _ = io.WriteString(c, head+"\r\n"+body)
	})
}
