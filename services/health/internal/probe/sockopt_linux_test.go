package probe_test

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// bindNoPort leaves the choice of the source port of a dial from a fixed
// source address to connect, which may reuse a port towards another
// destination, instead of bind, which needs a port no socket of that
// address holds: with ten thousand listeners and the TIME_WAIT sockets of
// thousands of probes a second, bind runs out of ports.
func bindNoPort(_, _ string, c syscall.RawConn) error {
	var err error
	if cerr := c.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
	}); cerr != nil {
		return cerr
	}
	return err
}
