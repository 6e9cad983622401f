// Package local is the local backend's [agent.Driver]: each proxy is its own
// OS process on this machine (the built-in forward proxy, or Squid when
// configured), listening on a port from a configured range and optionally
// sending from one source address of a configured list.
//
// The state directory is the marker. Each instance has one file
// <instance-name>.json, written atomically before its process starts, that
// records the marker (proxy id, pool, entry), the port, the source address,
// the mode and the process id with its start time. Proxy processes run in
// their own session, so they outlive the agent; a restarted agent finds them
// again from the state directory. Files that are not valid state are never
// touched.
package local

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// Config configures a [Driver].
type Config struct {
	// Entry is the provider entry this driver serves; it goes into markers.
	Entry string
	// Target is the name of this machine as a target.
	Target string
	// Ports is the inclusive range proxies listen on; the zero PortRange
	// has the kernel choose each proxy's port (built-in proxy only).
	Ports PortRange
	// Bind is the address proxies listen on (default 127.0.0.1).
	Bind string
	// SourceAddrs, when not empty, are the addresses outgoing connections
	// are made from: each proxy gets one, the least used first.
	SourceAddrs []string
	// StateDir holds one state file per instance, and a directory per
	// instance for its auth, config and log files.
	StateDir string
	// Squid is the squid binary; empty runs the built-in proxy.
	Squid string
	// SquidUser is the user squid drops to when started as root (default
	// "proxy", Debian's default): its files are handed to that user.
	SquidUser string
	// Executable is the local-agent binary, run as "<executable> proxy ..."
	// for the built-in proxy.
	Executable string
	// Capacity bounds the number of proxies; 0 means the size of Ports
	// (required when the kernel chooses the ports).
	Capacity int
}

// PortRange is an inclusive range of TCP ports. The zero PortRange, written
// "0", has the kernel choose each port.
type PortRange struct{ First, Last int }

// Kernel reports whether the kernel chooses each port.
func (r PortRange) Kernel() bool { return r == PortRange{} }

// Size is the number of ports in r (0 when the kernel chooses them).
func (r PortRange) Size() int {
	if r.Kernel() {
		return 0
	}
	return r.Last - r.First + 1
}

func (r PortRange) String() string {
	if r.Kernel() {
		return "0"
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// ParsePortRange parses "first-last", e.g. "20000-20999", or "0": the
// kernel chooses each port.
func ParsePortRange(s string) (PortRange, error) {
	if strings.TrimSpace(s) == "0" {
		return PortRange{}, nil
	}
	a, b, ok := strings.Cut(s, "-")
	first, err1 := strconv.Atoi(strings.TrimSpace(a))
	last, err2 := strconv.Atoi(strings.TrimSpace(b))
	if !ok || err1 != nil || err2 != nil {
		return PortRange{}, fmt.Errorf("port range %q: want FIRST-LAST, e.g. 20000-20999", s)
	}
	r := PortRange{First: first, Last: last}
	if first < 1 || last > 65535 || first > last {
		return PortRange{}, fmt.Errorf("port range %q: want 1 <= FIRST <= LAST <= 65535", s)
	}
	return r, nil
}

// Problems returns one error per problem with c (none when c is usable).
func (c *Config) Problems() []error {
	var out []error
	switch {
	case c.Ports.Kernel():
		if c.Squid != "" {
			out = append(out, errors.New("ports 0 (the kernel chooses) needs the built-in proxy: squid binds the port its configuration names; give a range"))
		}
		if c.Capacity == 0 {
			out = append(out, errors.New("ports 0 (the kernel chooses) needs a capacity: there is no range to size it"))
		}
	case c.Ports.First < 1 || c.Ports.Last > 65535 || c.Ports.First > c.Ports.Last:
		out = append(out, fmt.Errorf("ports %s: want 1 <= FIRST <= LAST <= 65535, or 0", c.Ports))
	}
	if ip := net.ParseIP(c.bind()); ip == nil {
		out = append(out, fmt.Errorf("bind %q: want an IP address", c.Bind))
	}
	seen := map[string]bool{}
	for _, a := range c.SourceAddrs {
		if net.ParseIP(a) == nil {
			out = append(out, fmt.Errorf("source address %q: want an IP address", a))
		} else if seen[a] {
			out = append(out, fmt.Errorf("source address %q is listed twice", a))
		}
		seen[a] = true
	}
	if c.StateDir == "" {
		out = append(out, errors.New("state directory is required"))
	}
	if c.Capacity < 0 {
		out = append(out, fmt.Errorf("capacity %d: want 0 (the port range size) or more", c.Capacity))
	}
	if c.Squid != "" {
		if err := executable(c.Squid); err != nil {
			out = append(out, fmt.Errorf("squid %q: %w", c.Squid, err))
		}
	} else if c.Executable == "" {
		out = append(out, errors.New("the local-agent executable is required for the built-in proxy"))
	}
	return out
}

func executable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return errors.New("not an executable file")
	}
	return nil
}

func (c *Config) bind() string {
	if c.Bind == "" {
		return "127.0.0.1"
	}
	return c.Bind
}

// EffectiveCapacity is Capacity, or the size of Ports when Capacity is 0.
func (c *Config) EffectiveCapacity() int {
	if c.Capacity == 0 {
		return c.Ports.Size()
	}
	return c.Capacity
}

func (c *Config) squidUser() string {
	if c.SquidUser == "" {
		return "proxy"
	}
	return c.SquidUser
}
