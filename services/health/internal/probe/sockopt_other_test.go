//go:build !linux

package probe_test

import "syscall"

// bindNoPort is a Linux socket option; elsewhere the port is bound as usual.
func bindNoPort(_, _ string, _ syscall.RawConn) error { return nil }
