package testnet_test

import (
	"errors"
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
