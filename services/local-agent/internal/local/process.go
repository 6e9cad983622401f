package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// envInstance is set in every proxy process's environment to the absolute
// path of its state file. It finds a process whose pid never reached the
// state file (a crash between start and record), and any helper it forked.
const envInstance = "PROXYFLEET_INSTANCE"

// procInfo is what /proc/<pid>/stat says about a process.
type procInfo struct {
	State     byte
	Session   int
	StartTime uint64
}

// readProc parses /proc/<pid>/stat.
func readProc(pid int) (procInfo, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return procInfo{}, err
	}
	// The command name (field 2) may hold spaces and parentheses: the
	// fields after it start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	// f[0] is field 3 (state), f[3] field 6 (session), f[19] field 22 (starttime).
	sid, err1 := strconv.Atoi(f[3])
	start, err2 := strconv.ParseUint(f[19], 10, 64)
	if err1 != nil || err2 != nil || len(f[0]) != 1 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	return procInfo{State: f[0][0], Session: sid, StartTime: start}, nil
}

// running reports whether p is a live (not zombie, not dead) process.
func (p procInfo) running() bool { return p.State != 'Z' && p.State != 'X' }

// alive reports whether pid runs and is the process that started at
// startTime (not a later process that reused the pid).
func alive(pid int, startTime uint64) bool {
	if pid <= 0 {
		return false
	}
	p, err := readProc(pid)
	return err == nil && p.running() && p.StartTime == startTime
}

// markedProcesses returns the live processes whose environment carries
// envInstance=statePath. leaders are those that lead their own session (the
// proxy processes we started); all includes helpers they forked.
func markedProcesses(statePath string) (leaders, all []int) {
	want := []byte(envInstance + "=" + statePath + "\x00")
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, nil
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", d.Name(), "environ"))
		if err != nil || !bytes.Contains(append([]byte{0}, env...), append([]byte{0}, want...)) {
			continue
		}
		p, err := readProc(pid)
		if err != nil || !p.running() {
			continue
		}
		all = append(all, pid)
		if p.Session == pid {
			leaders = append(leaders, pid)
		}
	}
	return leaders, all
}

// launch describes one proxy process.
type launch struct {
	argv      []string
	dir       string // working directory
	logPath   string // stdout and stderr go here
	statePath string
	builtin   bool     // the built-in proxy, which can serve on an inherited listener
	listener  *os.File // the proxy's listening socket, its fd 3; nil when it binds its own
}

// handOver prepares to give ln, which holds the proxy's port, to the
// process: the built-in proxy serves on it (fd 3), so the port is never
// free between its choice and the proxy's start. Squid binds the port its
// configuration names, so for Squid ln is closed now. ln is closed either
// way once the process has started (the process holds its own copy).
func (l *launch) handOver(ln net.Listener) error {
	if ln == nil {
		return nil
	}
	if !l.builtin {
		return ln.Close()
	}
	f, err := ln.(*net.TCPListener).File()
	if err != nil {
		return fmt.Errorf("hand the listener on %s to the proxy: %w", ln.Addr(), err)
	}
	l.listener = f
	l.argv = append(l.argv, "--listen-fd", "3")
	return nil
}

// start runs l in its own session (so it outlives the agent and a Ctrl-C
// of its terminal) and returns its pid and start time. The child is reaped
// in the background while this process lives.
func start(l launch) (int, uint64, error) {
	logf, err := os.OpenFile(l.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, 0, err
	}
	defer logf.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		return 0, 0, err
	}
	defer null.Close()
	// A minimal environment: the agent's own (NATS credentials, tokens)
	// is none of the proxy's business.
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"LANG=C",
		envInstance + "=" + l.statePath,
	}
	files := []*os.File{null, logf, logf}
	if l.listener != nil {
		defer l.listener.Close()
		files = append(files, l.listener)
	}
	proc, err := os.StartProcess(l.argv[0], l.argv, &os.ProcAttr{
		Dir:   l.dir,
		Env:   env,
		Files: files,
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return 0, 0, err
	}
	go func() { _, _ = proc.Wait() }()
	info, err := readProc(proc.Pid)
	if err != nil {
		// It exited already and was reaped; the caller sees a dead pid.
		return proc.Pid, 0, nil
	}
	return proc.Pid, info.StartTime, nil
}

// stop ends every process of the instance behind statePath: SIGTERM to the
// process groups, then SIGKILL after grace, and verifies none is left.
func stop(ctx context.Context, pid int, startTime uint64, statePath string, grace time.Duration) error {
	signal := func(sig syscall.Signal) int {
		leaders, all := markedProcesses(statePath)
		if alive(pid, startTime) {
			leaders = append(leaders, pid)
		}
		for _, p := range leaders {
			_ = syscall.Kill(-p, sig) // the whole session's process group
		}
		for _, p := range all {
			_ = syscall.Kill(p, sig)
		}
		return len(all) + len(leaders)
	}
	gone := func() bool {
		_, all := markedProcesses(statePath)
		return len(all) == 0 && !alive(pid, startTime)
	}
	if signal(syscall.SIGTERM) == 0 {
		return nil
	}
	if waitFor(ctx, grace, gone) {
		return nil
	}
	signal(syscall.SIGKILL)
	if waitFor(ctx, 5*time.Second, gone) {
		return nil
	}
	return fmt.Errorf("proxy process of %s still runs after SIGKILL", filepath.Base(statePath))
}

// waitFor polls cond until it holds (true), or d or ctx runs out (false).
func waitFor(ctx context.Context, d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// processAge returns how long the process that started at startTime
// (clock ticks since boot, /proc/<pid>/stat field 22) has run. /proc counts
// in USER_HZ, which Linux fixes at 100 for user space.
func processAge(startTime uint64) (time.Duration, error) {
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, errors.New("/proc/uptime: unexpected format")
	}
	up, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/uptime: %w", err)
	}
	const userHZ = 100
	return time.Duration((up - float64(startTime)/userHZ) * float64(time.Second)), nil
}

// listeningPorts returns the TCP ports with a listening socket in this
// network namespace, from /proc/net/tcp and /proc/net/tcp6 (one read each,
// no connection to anything).
func listeningPorts() (map[int]bool, error) {
	ports := map[int]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue // no IPv6
		}
		if err != nil {
			return nil, err
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			// "  0: 0100007F:4E20 00000000:0000 0A ...": local address, remote
			// address, state (0A is LISTEN).
			fields := strings.Fields(line)
			if len(fields) < 4 || fields[3] != "0A" {
				continue
			}
			i := strings.LastIndexByte(fields[1], ':')
			if i < 0 {
				continue
			}
			if port, err := strconv.ParseUint(fields[1][i+1:], 16, 16); err == nil {
				ports[int(port)] = true
			}
		}
	}
	return ports, nil
}

// accepts reports whether something accepts TCP connections at addr.
func accepts(ctx context.Context, addr string) bool {
	d := net.Dialer{Timeout: time.Second}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// joinHostPort is net.JoinHostPort with an int port.
func joinHostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// dialHost is where to connect to reach a listener on bind: a wildcard
// bind is reached on loopback.
func dialHost(bind string) string {
	switch ip := net.ParseIP(bind); {
	case ip == nil:
		return bind
	case ip.Equal(net.IPv4zero):
		return "127.0.0.1"
	case ip.Equal(net.IPv6unspecified):
		return "::1"
	}
	return bind
}

var errExited = errors.New("proxy process exited")
