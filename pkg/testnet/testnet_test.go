package testnet_test

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"proxyfleet/pkg/testnet"
)

func TestRefusingRefusesAndHoldsThePort(t *testing.T) {
	addr := testnet.Refusing(t).String()
	if _, err := net.Dial("tcp", addr); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial %s = %v, want connection refused", addr, err)
	}
	if ln, err := net.Listen("tcp", addr); err == nil {
		ln.Close()
		t.Fatalf("listen on reserved %s succeeded; the port is not held", addr)
	}
}

// TestKillableRefusesOnceClosed: a Killable listener serves until it is
// closed; then a dial is refused and its port cannot be taken by another
// listener.
func TestKillableRefusesOnceClosed(t *testing.T) {
	ln := testnet.Killable(t)
	addr := ln.Addr().String()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial %s while it listens: %v", addr, err)
	}
	c.Close()
	ln.Close()
	if _, err := net.Dial("tcp", addr); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial %s after close = %v, want connection refused", addr, err)
	}
	if other, err := net.Listen("tcp", addr); err == nil {
		other.Close()
		t.Fatalf("listen on %s after close succeeded; the port is not held", addr)
	}
}

// TestSharedPortServesTheChildListener: a listener that also asks for
// SO_REUSEPORT binds the reserved port and receives its connections.
func TestSharedPortServesTheChildListener(t *testing.T) {
	addr := testnet.Shared(t).String()
	if ln, err := net.Listen("tcp", addr); err == nil {
		ln.Close()
		t.Fatalf("plain listen on shared %s succeeded; the port is not held", addr)
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(t.Context(), "tcp", addr)
	if err != nil {
		t.Fatalf("SO_REUSEPORT listen on %s: %v", addr, err)
	}
	defer ln.Close()
	for range 5 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		c.Close()
		a, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		a.Close()
	}
}

func TestCountCountsAndGreets(t *testing.T) {
	c := testnet.Count(t, "127.0.0.1:0", "hello\n")
	if n := c.Accepted(); n != 0 {
		t.Fatalf("Accepted() = %d before any dial, want 0", n)
	}
	for i := 0; i < 2; i++ {
		conn, err := net.Dial("tcp", c.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || string(got) != "hello\n" {
			t.Fatalf("read %q, %v; want the greeting, then the close", got, err)
		}
	}
	if n := c.Accepted(); n != 2 {
		t.Fatalf("Accepted() = %d, want 2", n)
	}
}
