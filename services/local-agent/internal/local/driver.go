package local

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

var _ agent.Driver = (*Driver)(nil)

// Timing of process handling.
const (
	// startTimeout bounds waiting for a new process's port to accept.
	startTimeout = 30 * time.Second
	// stopGrace is how long a process has to exit after SIGTERM.
	stopGrace = 5 * time.Second
	// portReleaseWait is how long a restart waits for the port of a dead
	// process to become free before moving to another port.
	portReleaseWait = 3 * time.Second
)

// Driver runs proxies as local processes. It is safe for concurrent use;
// calls for one instance are serialised, and port allocation is atomic
// within the driver. One state directory belongs to one agent.
type Driver struct {
	cfg    Config
	states stateStore
	log    *slog.Logger

	// startGrace is how long a live process may go without listening
	// before it counts as terminated (startTimeout; tests shorten it).
	startGrace time.Duration

	allocMu sync.Mutex // held from choosing a port to writing its state
	mu      sync.Mutex
	locks   map[string]*sync.Mutex
}

// New returns a driver for cfg, creating the state directory. Invalid
// configuration is an [agent.ErrPermanent] error naming every problem.
func New(cfg Config, log *slog.Logger) (*Driver, error) {
	if errs := cfg.Problems(); len(errs) > 0 {
		return nil, agent.Wrap(agent.ErrPermanent, errors.Join(errs...))
	}
	dir, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, agent.Wrap(agent.ErrPermanent, err)
	}
	cfg.StateDir = dir
	// Others may traverse it: Squid drops to its own user and must reach
	// its instance directory. Secrets inside are 0600.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, agent.Wrapf(agent.ErrPermanent, "state directory: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Driver{cfg: cfg, states: stateStore{dir: dir}, log: log, locks: map[string]*sync.Mutex{}, startGrace: startTimeout}
	if cfg.Squid != "" && os.Geteuid() == 0 {
		if v := d.checkSquidAccess(); !v.OK {
			return nil, agent.Wrapf(agent.ErrPermanent, "squid mode: %s; make the state directory and its parents searchable (chmod o+x) or choose another state directory", v.Detail)
		}
	}
	return d, nil
}

// lock serialises work on one instance.
func (d *Driver) lock(name string) func() {
	d.mu.Lock()
	m, ok := d.locks[name]
	if !ok {
		m = &sync.Mutex{}
		d.locks[name] = m
	}
	d.mu.Unlock()
	m.Lock()
	return m.Unlock
}

func checkName(name string) error {
	if !events.IsIdentifier(name) {
		return agent.Wrapf(agent.ErrPermanent, "instance name %q: must be %s", name, events.IdentifierRule)
	}
	return nil
}

// Create starts the proxy process of spec.Name, or finds the one an earlier
// call started. With state but no live process it restarts the proxy on the
// same port; without state it allocates a port, writes the state, then
// starts the process and records its pid. spec.Port is not used: local
// ports come from the configured range. It returns once the port accepts
// connections.
func (d *Driver) Create(ctx context.Context, spec agent.Spec) (agent.Instance, error) {
	if err := checkName(spec.Name); err != nil {
		return agent.Instance{}, err
	}
	defer d.lock(spec.Name)()
	log := d.log.With("proxy", spec.ProxyID, "instance", spec.Name)

	s, err := d.states.read(spec.Name)
	// ln holds the proxy's port from its choice until the proxy has it.
	var ln net.Listener
	defer func() {
		if ln != nil {
			ln.Close()
		}
	}()
	switch {
	case errors.Is(err, errNoState):
		if s, ln, err = d.allocate(spec); err != nil {
			return agent.Instance{}, err
		}
		log.Info("allocated", "address", s.address(), "source", s.SourceAddr, "mode", s.Mode)
	case err != nil:
		return agent.Instance{}, err
	case s.Marker != spec.Marker():
		return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "instance %s belongs to proxy %s of pool %s, not %s", s.Name, s.Marker.ProxyID, s.Marker.Pool, spec.ProxyID)
	default:
		if ok, err := d.adopt(s); err != nil {
			return agent.Instance{}, err
		} else if ok {
			return d.waitReady(ctx, s)
		}
		if !waitFor(ctx, portReleaseWait, func() bool {
			ln, _ = net.Listen("tcp", s.address())
			return ln != nil
		}) {
			// No process of ours holds it (a dying one releases it within
			// moments): another program took it, so move to a free port.
			if s, ln, err = d.reallocate(s); err != nil {
				return agent.Instance{}, err
			}
		}
		log.Info("restarting proxy process", "address", s.address())
	}
	l, err := d.prepare(s, spec.Auth, spec.Egress)
	if err != nil {
		return agent.Instance{}, err
	}
	if err := l.handOver(ln); err != nil {
		return agent.Instance{}, err
	}
	s.Auth = spec.Auth != nil
	pid, startTime, err := start(l)
	if err != nil {
		return agent.Instance{}, fmt.Errorf("start %s: %w", l.argv[0], err)
	}
	s.PID, s.StartTime = pid, startTime
	if err := d.states.write(s); err != nil {
		// The process runs and carries its marker in its environment:
		// the next Create or Delete finds it.
		return agent.Instance{}, err
	}
	log.Info("proxy process started", "pid", pid, "address", s.address())
	return d.waitReady(ctx, s)
}

// adopt reports whether s has a live process, recording it when the state
// lacks its pid (a crash between start and record) and stopping extra
// ones, which only an outside hand can have started.
func (d *Driver) adopt(s *state) (bool, error) {
	if alive(s.PID, s.StartTime) {
		return true, nil
	}
	leaders, _ := markedProcesses(d.states.path(s.Name))
	if len(leaders) == 0 {
		return false, nil
	}
	for _, extra := range leaders[1:] {
		d.log.Warn("stopping duplicate proxy process", "instance", s.Name, "pid", extra)
		p, _ := readProc(extra)
		_ = stop(context.Background(), extra, p.StartTime, "", stopGrace)
	}
	p, err := readProc(leaders[0])
	if err != nil {
		return false, nil
	}
	s.PID, s.StartTime = leaders[0], p.StartTime
	return true, d.states.write(s)
}

// waitReady waits until the process of s accepts connections.
func (d *Driver) waitReady(ctx context.Context, s *state) (agent.Instance, error) {
	addr := joinHostPort(dialHost(s.Bind), s.Port)
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	for {
		if accepts(ctx, addr) {
			return d.instance(s, agent.StateRunning, ""), nil
		}
		if !alive(s.PID, s.StartTime) {
			return agent.Instance{}, agent.Wrapf(agent.ErrTransient, "%w: %s on %s: %s", errExited, s.Name, s.address(), d.logTail(s.Name))
		}
		select {
		case <-ctx.Done():
			return agent.Instance{}, agent.Wrapf(agent.ErrTransient, "%s does not accept connections on %s yet: %w", s.Name, s.address(), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// logTail returns the last lines of the instance's process log, for errors.
func (d *Driver) logTail(name string) string {
	dir := d.states.instanceDir(name)
	var parts []string
	for _, f := range []string{fileLog, "cache.log"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil || len(b) == 0 {
			continue
		}
		if len(b) > 600 {
			b = b[len(b)-600:]
		}
		parts = append(parts, f+": "+strings.TrimSpace(string(b)))
	}
	if len(parts) == 0 {
		return "no output"
	}
	return strings.Join(parts, "; ")
}

func (d *Driver) instance(s *state, st agent.State, detail string) agent.Instance {
	return agent.Instance{Name: s.Name, Marker: s.Marker, State: st, Address: s.address(), Detail: detail}
}

// Get reports the instance's state: running when its process lives and its
// port accepts, provisioning when it lives but does not accept yet,
// terminated when no process runs. It records the pid of a live process the
// state file lacks.
func (d *Driver) Get(ctx context.Context, ref agent.Ref) (agent.Instance, error) {
	if err := checkName(ref.Name); err != nil {
		return agent.Instance{}, err
	}
	s, err := d.states.read(ref.Name)
	if errors.Is(err, errNoState) {
		return agent.Instance{}, agent.Wrapf(agent.ErrNotFound, "instance %s has no state in %s", ref.Name, d.cfg.StateDir)
	}
	if err != nil {
		return agent.Instance{}, err
	}
	if !alive(s.PID, s.StartTime) {
		// A process whose pid never reached the state file (a crash between
		// start and record) is recorded now.
		unlock := d.lock(ref.Name)
		s, err = d.states.read(ref.Name)
		var found bool
		if err == nil {
			found, err = d.adopt(s)
		}
		unlock()
		if errors.Is(err, errNoState) {
			return agent.Instance{}, agent.Wrapf(agent.ErrNotFound, "instance %s has no state in %s", ref.Name, d.cfg.StateDir)
		}
		if err != nil {
			return agent.Instance{}, err
		}
		if !found {
			return d.instance(s, agent.StateTerminated, gone(s)), nil
		}
	}
	if !accepts(ctx, joinHostPort(dialHost(s.Bind), s.Port)) {
		if d.pastStart(s) {
			return d.instance(s, agent.StateTerminated, deaf(s)), nil
		}
		return d.instance(s, agent.StateProvisioning, "port does not accept connections yet"), nil
	}
	return d.instance(s, agent.StateRunning, ""), nil
}

// gone and deaf are the details of a terminated instance.
func gone(s *state) string {
	if s.PID == 0 {
		return "proxy process was never recorded and none runs"
	}
	return fmt.Sprintf("proxy process %d is gone", s.PID)
}

func deaf(s *state) string {
	return fmt.Sprintf("proxy process %d runs but does not listen on %s", s.PID, s.address())
}

// pastStart reports whether the process of s has run longer than a start
// may take, so not listening means it is broken, not starting.
func (d *Driver) pastStart(s *state) bool {
	age, err := processAge(s.StartTime)
	return err == nil && age >= d.startGrace
}

// Delete stops the instance's processes, verifies they are gone, and
// removes its files, the state file last. An instance without state is
// already gone: success.
func (d *Driver) Delete(ctx context.Context, ref agent.Ref) error {
	if err := checkName(ref.Name); err != nil {
		return err
	}
	defer d.lock(ref.Name)()
	s, err := d.states.read(ref.Name)
	if errors.Is(err, errNoState) {
		return nil
	}
	if err != nil {
		return err
	}
	if ref.ProxyID != "" && s.Marker.ProxyID != ref.ProxyID {
		return agent.Wrapf(agent.ErrPermanent, "instance %s belongs to proxy %s, not %s; left untouched", s.Name, s.Marker.ProxyID, ref.ProxyID)
	}
	if err := stop(ctx, s.PID, s.StartTime, d.states.path(s.Name), stopGrace); err != nil {
		return agent.Wrap(agent.ErrTransient, err)
	}
	if err := os.RemoveAll(d.states.instanceDir(s.Name)); err != nil {
		return err
	}
	if err := d.states.remove(s.Name); err != nil {
		return err
	}
	d.log.Info("proxy deleted", "proxy", s.Marker.ProxyID, "instance", s.Name, "address", s.address())
	return nil
}

// List returns the instances recorded in the state directory with their
// state, cheaply: no connection to any proxy and no lock. A process is
// checked by its /proc entry and its port by the kernel's listening
// sockets (/proc/net/tcp and tcp6, read once per call). Running means the
// process lives and a socket listens on its port; terminated means no
// process of the instance runs (a pid the state lacks is looked for by its
// marker, as Get does), or it has run longer than a start may take without
// listening; anything else is provisioning.
func (d *Driver) List(ctx context.Context) ([]agent.Instance, error) {
	states, err := d.states.list()
	if err != nil {
		return nil, err
	}
	var listening map[int]bool
	out := make([]agent.Instance, 0, len(states))
	for _, s := range states {
		if !alive(s.PID, s.StartTime) {
			leaders, _ := markedProcesses(d.states.path(s.Name))
			if len(leaders) == 0 {
				out = append(out, d.instance(s, agent.StateTerminated, gone(s)))
				continue
			}
			p, err := readProc(leaders[0])
			if err != nil {
				out = append(out, d.instance(s, agent.StateProvisioning, "proxy process not recorded yet"))
				continue
			}
			found := *s
			found.PID, found.StartTime = leaders[0], p.StartTime
			s = &found
		}
		if listening == nil {
			if listening, err = listeningPorts(); err != nil {
				return nil, err
			}
		}
		switch {
		case listening[s.Port]:
			out = append(out, d.instance(s, agent.StateRunning, ""))
		case d.pastStart(s):
			out = append(out, d.instance(s, agent.StateTerminated, deaf(s)))
		default:
			out = append(out, d.instance(s, agent.StateProvisioning, "port does not accept connections yet"))
		}
	}
	return out, nil
}
