package local

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/user"
	"strconv"

	"proxyfleet/pkg/agent"
)

// allocate picks a free port and the least-used source address for a new
// instance and writes its state (without a pid) before anything starts. It
// returns the port's listener, held so that nothing takes the port before
// the proxy does; the caller closes it.
func (d *Driver) allocate(spec agent.Spec) (*state, net.Listener, error) {
	d.allocMu.Lock()
	defer d.allocMu.Unlock()
	states, err := d.states.list()
	if err != nil {
		return nil, nil, err
	}
	if len(states) >= d.cfg.EffectiveCapacity() {
		return nil, nil, agent.Wrapf(agent.ErrQuotaExceeded, "capacity of %d proxies reached on %s", d.cfg.EffectiveCapacity(), d.cfg.Target)
	}
	ln, port, err := d.freePort(states)
	if err != nil {
		return nil, nil, err
	}
	mode := modeBuiltin
	if d.cfg.Squid != "" {
		mode = modeSquid
	}
	s := &state{
		Kind: stateKind, Name: spec.Name, Marker: spec.Marker(),
		Bind: d.cfg.bind(), Port: port, SourceAddr: d.sourceAddr(states), Mode: mode,
	}
	if err := d.states.write(s); err != nil {
		ln.Close()
		return nil, nil, err
	}
	return s, ln, nil
}

// reallocate moves s, whose process is not running, to a free port, and
// returns that port's listener like allocate.
func (d *Driver) reallocate(s *state) (*state, net.Listener, error) {
	d.allocMu.Lock()
	defer d.allocMu.Unlock()
	states, err := d.states.list()
	if err != nil {
		return nil, nil, err
	}
	ln, port, err := d.freePort(states)
	if err != nil {
		return nil, nil, err
	}
	moved := *s
	moved.Port, moved.PID, moved.StartTime = port, 0, 0
	if err := d.states.write(&moved); err != nil {
		ln.Close()
		return nil, nil, err
	}
	d.log.Warn("port taken by another program; proxy moved", "instance", s.Name, "from", s.Port, "to", port)
	return &moved, ln, nil
}

// freePort listens on a port for a new proxy: one the kernel chooses, or
// the lowest of the range that no state records and that is free now. The
// listener is held until the proxy has the port, so no other program can
// take it between the choice and the proxy's start.
func (d *Driver) freePort(states []*state) (net.Listener, int, error) {
	if d.cfg.Ports.Kernel() {
		ln, err := net.Listen("tcp", joinHostPort(d.cfg.bind(), 0))
		if err != nil {
			return nil, 0, fmt.Errorf("listen on %s: %w", d.cfg.bind(), err)
		}
		return ln, ln.Addr().(*net.TCPAddr).Port, nil
	}
	used := make(map[int]bool, len(states))
	for _, s := range states {
		used[s.Port] = true
	}
	for p := d.cfg.Ports.First; p <= d.cfg.Ports.Last; p++ {
		if used[p] {
			continue
		}
		if ln, err := net.Listen("tcp", joinHostPort(d.cfg.bind(), p)); err == nil {
			return ln, p, nil
		}
	}
	return nil, 0, agent.Wrapf(agent.ErrQuotaExceeded, "no free port in %s on %s", d.cfg.Ports, d.cfg.bind())
}

// sourceAddr returns the configured source address used by the fewest
// instances (the first listed on a tie), or "" when none is configured.
func (d *Driver) sourceAddr(states []*state) string {
	if len(d.cfg.SourceAddrs) == 0 {
		return ""
	}
	count := map[string]int{}
	for _, s := range states {
		count[s.SourceAddr]++
	}
	best := d.cfg.SourceAddrs[0]
	for _, a := range d.cfg.SourceAddrs[1:] {
		if count[a] < count[best] {
			best = a
		}
	}
	return best
}

// Check reports whether the state directory is writable, how many ports
// are left, and whether the proxy binary is present.
func (d *Driver) Check(ctx context.Context) []agent.Verdict {
	var out []agent.Verdict
	v := agent.Verdict{Check: "state-dir", OK: true, Detail: d.cfg.StateDir + " is writable"}
	if f, err := os.CreateTemp(d.cfg.StateDir, ".check-*"); err != nil {
		v.OK, v.Detail = false, err.Error()
	} else {
		f.Close()
		os.Remove(f.Name())
	}
	out = append(out, v)

	states, err := d.states.list()
	v = agent.Verdict{Check: "ports", OK: true}
	if err != nil {
		v.OK, v.Detail = false, err.Error()
	} else {
		room := d.cfg.EffectiveCapacity() - len(states)
		if !d.cfg.Ports.Kernel() {
			room = min(room, d.cfg.Ports.Size()-len(states))
		}
		v.OK = room > 0
		v.Detail = fmt.Sprintf("%d proxies, room for %d more (ports %s, capacity %d)", len(states), max(room, 0), d.cfg.Ports, d.cfg.EffectiveCapacity())
	}
	out = append(out, v)

	bin, name := d.cfg.Executable, "proxy-binary"
	if d.cfg.Squid != "" {
		bin, name = d.cfg.Squid, "squid"
	}
	v = agent.Verdict{Check: name, OK: true, Detail: bin}
	if err := executable(bin); err != nil {
		v.OK, v.Detail = false, bin+": "+err.Error()
	}
	out = append(out, v)
	if d.cfg.Squid != "" && os.Geteuid() == 0 {
		out = append(out, d.checkSquidAccess())
	}
	return out
}

// checkSquidAccess verifies that the user squid drops to can reach the
// state directory.
func (d *Driver) checkSquidAccess() agent.Verdict {
	v := agent.Verdict{Check: "squid-access", OK: true, Detail: "user " + d.cfg.squidUser() + " can reach " + d.cfg.StateDir}
	u, err := user.Lookup(d.cfg.squidUser())
	if err != nil {
		v.OK, v.Detail = false, err.Error()
		return v
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := searchable(d.cfg.StateDir, uid, gid); err != nil {
		v.OK, v.Detail = false, "user "+d.cfg.squidUser()+": "+err.Error()
	}
	return v
}
