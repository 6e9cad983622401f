package forward_test

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"proxyfleet/services/gateway/internal/gctarget"
)

// benchTunnels is how many tunnels BenchmarkGatewayTunnels holds open at
// once (-args -forward.tunnels=N to change it), and tunnelsLimitMB the
// most the gateway process may hold resident while it carries 5,000.
var benchTunnels = flag.Int("forward.tunnels", 5000, "tunnels BenchmarkGatewayTunnels holds open at once")

const tunnelsLimitMB = 500

// fdsPerTunnel is what each tunnel costs a proxy process in open files:
// its two sockets, and the pipe (two ends) that each direction's
// io.Copy holds for splice(2) for as long as the tunnel is open.
const fdsPerTunnel = 6

// envProfileDir, when set, names a directory where every helper process
// writes a CPU profile, <benchmark>-<role>.cpu.pprof.
const envProfileDir = "PROXYFLEET_BENCH_PROFILE_DIR"

// The environment of a helper process (see [TestForwardHelperProcess]).
const (
	helperRoleEnv     = "PROXYFLEET_FORWARD_HELPER"
	helperUpstreamEnv = "PROXYFLEET_FORWARD_UPSTREAM"
)

// BenchmarkGatewayTunnels holds [benchTunnels] CONNECT tunnels open at
// once, each from a client through a proxy to an echo server, checks that
// every one carries bytes both ways (when it opens, and again once all
// are open), and reads the resident memory (VmRSS) of the process the
// tunnels go through:
//
//   - baseline: the tunnels go straight through the upstream proxy (a
//     minimal forward proxy: hijack and io.Copy both ways, see
//     [upstreamProxy]); rss-MB is that proxy's process, the least a Go
//     proxy holding these tunnels needs.
//   - gateway: the tunnels go through the gateway and then the same
//     upstream proxy; rss-MB is the gateway's process. Goal: at most
//     [tunnelsLimitMB] for 5,000 tunnels.
//
// The upstream proxy and the gateway each run in a process of their own
// (the test binary again, see [TestForwardHelperProcess]) so that rss-MB
// is theirs alone: the clients and the echo server run in this process.
// idle-MB is the same process before the tunnels opened, kB/tunnel the
// growth per tunnel, at-5000-MB idle-MB plus 5,000 times kB/tunnel (equal
// to rss-MB when tunnels is 5,000; an extrapolation when the open-files
// limit allowed fewer), fds the process's open files with the tunnels
// open, open-s the time to open them 64 at a time. MB is 2^20 bytes.
// ns/op is not a result (reported as 0).
func BenchmarkGatewayTunnels(b *testing.B) {
	tunnels, note := openFilesForTunnels(b, *benchTunnels)
	echo := newEcho(b)
	upstream := startHelper(b, "upstream", "")
	gateway := startHelper(b, "gateway", upstream.addr)
	for _, v := range []struct {
		name      string
		via       *helper // the process the tunnels go through first, whose memory is read
		wantProxy string
	}{
		{"baseline", upstream, ""},
		{"gateway", gateway, benchProxyID},
	} {
		// One measurement per sub-benchmark, whatever b.N: the result is
		// the memory the tunnels hold, not a rate, and a second round
		// would start from the heap the first one grew.
		var m *tunnelsMemory
		b.Run(v.name, func(b *testing.B) {
			if m == nil {
				mm := holdTunnels(b, tunnels, v.via, echo, v.wantProxy)
				m = &mm
				if note != "" {
					b.Log(note)
				}
			}
			perTunnel := float64(m.rss-m.idle) / float64(tunnels) // kB
			at5000 := mb(m.idle) + perTunnel*5000/1024
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(0, "B/op")
			b.ReportMetric(0, "allocs/op")
			b.ReportMetric(float64(tunnels), "tunnels")
			b.ReportMetric(mb(m.rss), "rss-MB")
			b.ReportMetric(mb(m.idle), "idle-MB")
			b.ReportMetric(perTunnel, "kB/tunnel")
			b.ReportMetric(at5000, "at-5000-MB")
			b.ReportMetric(float64(m.fds), "fds")
			b.ReportMetric(m.open.Seconds(), "open-s")
			if v.name == "gateway" && at5000 > tunnelsLimitMB {
				b.Errorf("the gateway holds %.1f MB resident with %d tunnels open (%.1f kB each over %.1f MB idle): %.0f MB for 5,000, over the limit of %d MB", mb(m.rss), tunnels, perTunnel, mb(m.idle), at5000, tunnelsLimitMB)
			}
		})
	}
	gateway.stop(b)
	upstream.stop(b)
}

// tunnelsMemory is what one run of [holdTunnels] read of the process the
// tunnels went through.
type tunnelsMemory struct {
	idle, rss int // VmRSS, kB: before the tunnels, with all of them open
	fds       int
	open      time.Duration // to open every tunnel
}

func mb(kb int) float64 { return float64(kb) / 1024 }

// holdTunnels opens that many tunnels through via to echo, checks each,
// reads via's memory with all of them open, checks each again and closes
// them.
func holdTunnels(b *testing.B, tunnels int, via *helper, echo, wantProxy string) tunnelsMemory {
	b.Helper()
	var m tunnelsMemory
	m.idle = via.rss(b)
	conns := make([]net.Conn, tunnels)
	defer func() {
		for _, c := range conns {
			if c != nil {
				_ = c.Close()
			}
		}
	}()
	start := time.Now()
	if err := eachTunnel(tunnels, func(i int) error {
		c, err := openTunnel(via.addr, echo, wantProxy)
		if err != nil {
			return fmt.Errorf("tunnel %d: %w", i, err)
		}
		conns[i] = c
		return echoRoundTrip(c, tunnelMessage(i, "open"))
	}); err != nil {
		b.Fatal(err)
	}
	m.open = time.Since(start)
	m.rss = via.rss(b)
	m.fds = via.fds(b)
	if err := eachTunnel(tunnels, func(i int) error {
		return echoRoundTrip(conns[i], tunnelMessage(i, "still open"))
	}); err != nil {
		b.Fatal(err)
	}
	return m
}

func tunnelMessage(i int, what string) []byte {
	return []byte(fmt.Sprintf("tunnel %d %s\n", i, what))
}

// eachTunnel calls f for every tunnel index, from a few workers at once,
// and returns the first error.
func eachTunnel(n int, f func(i int) error) error {
	const workers = 64
	var (
		next  = make(chan int)
		wg    sync.WaitGroup
		first firstError
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := f(i); err != nil {
					first.set(err)
				}
			}
		}()
	}
	for i := 0; i < n && first.get() == nil; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	return first.get()
}

// openFilesForTunnels raises this process's open-files limit (which the
// helpers inherit) so that each proxy process can hold want tunnels, and
// returns how many tunnels the benchmark holds: want, or when the limit
// cannot rise that far, the most it allows in steps of 500, with a note
// saying so.
func openFilesForTunnels(b *testing.B, want int) (int, string) {
	b.Helper()
	const spare = 256 // the test binary's own files, in each process
	need := uint64(fdsPerTunnel*want + spare)
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	if lim.Cur >= need {
		return want, ""
	}
	err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: need, Max: max(lim.Max, need)})
	if err == nil {
		return want, ""
	}
	// Without the privilege to raise the hard limit, use all of it.
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	n := (int(lim.Max) - spare) / fdsPerTunnel / 500 * 500
	if n < 500 {
		b.Skipf("open files limit %d cannot be raised to %d (%v): %d tunnels need %d open files in each proxy process (%d per tunnel); raise the hard limit (ulimit -Hn) to run this benchmark", lim.Max, need, err, want, need, fdsPerTunnel)
	}
	return n, fmt.Sprintf("open files limit %d cannot be raised to %d (%v): holding %d tunnels, not %d (%d open files per tunnel in each proxy process); at-5000-MB extrapolates kB/tunnel; raise the hard limit (ulimit -Hn) to measure %d", lim.Max, need, err, n, want, fdsPerTunnel, want)
}

// TestForwardHelperProcess is not a test: BenchmarkGatewayTunnels and
// the front-end benchmarks run the test binary again with [helperRoleEnv]
// set to "upstream" or "gateway" to serve that proxy in a process of its
// own (a gateway routes to the proxies [helperUpstreamEnv] lists, comma
// separated). It prints "listening <addr>" and serves until its stdin
// closes.
func TestForwardHelperProcess(t *testing.T) {
	var addr string
	switch role := os.Getenv(helperRoleEnv); role {
	case "":
		return
	case "upstream":
		addr = serve(t, newUpstreamProxy(""))
	case "gateway":
		gctarget.Apply() // as cmd/gateway does
		var fleet *benchFleet
		addr, fleet = newGateway(t, strings.Split(os.Getenv(helperUpstreamEnv), ",")...)
		defer func() {
			if n, reason := fleet.suspected(); n > 0 {
				t.Errorf("the gateway reported an upstream proxy suspect %d times (last: %s)", n, reason)
			}
		}()
	default:
		t.Fatalf("%s=%q: want upstream or gateway", helperRoleEnv, role)
	}
	fmt.Printf("listening %s\n", addr)
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// helper is a proxy running in a process of its own.
type helper struct {
	role   string
	addr   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	exited chan error // receives Wait's result, with what it printed after its address
}

// startHelper starts the test binary as a helper process serving role
// (see [TestForwardHelperProcess]) and waits until it listens.
func startHelper(b *testing.B, role, upstream string) *helper {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	args := []string{"-test.run=^TestForwardHelperProcess$", "-test.count=1"}
	if dir := os.Getenv(envProfileDir); dir != "" {
		// The helper's profile is written when it stops; the benchmark's
		// own -cpuprofile holds the clients and the upstream proxies.
		args = append(args, "-test.cpuprofile="+filepath.Join(dir, fmt.Sprintf("%s-%s.cpu.pprof", strings.ReplaceAll(b.Name(), "/", "-"), role)))
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), helperRoleEnv+"="+role, helperUpstreamEnv+"="+upstream)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	h := &helper{role: role, cmd: cmd, stdin: stdin, exited: make(chan error, 1)}
	line := make(chan string, 1)
	go func() {
		r := bufio.NewReader(stdout)
		l, _ := r.ReadString('\n')
		line <- l
		// Its test failures, if any, and PASS or FAIL.
		rest, _ := io.ReadAll(r)
		if err := cmd.Wait(); err != nil {
			h.exited <- fmt.Errorf("%w\n%s", err, rest)
			return
		}
		h.exited <- nil
	}()
	b.Cleanup(func() {
		_ = h.cmd.Process.Kill()
	})
	select {
	case l := <-line:
		var ok bool
		if h.addr, ok = strings.CutPrefix(strings.TrimSpace(l), "listening "); !ok {
			b.Fatalf("%s helper: printed %q, want \"listening <addr>\"", role, l)
		}
	case <-time.After(30 * time.Second):
		b.Fatalf("%s helper: not listening after 30s", role)
	}
	return h
}

// stop closes the helper's stdin and waits for it to exit.
func (h *helper) stop(b *testing.B) {
	b.Helper()
	_ = h.stdin.Close()
	select {
	case err := <-h.exited:
		if err != nil {
			b.Errorf("%s helper: %v", h.role, err)
		}
	case <-time.After(30 * time.Second):
		b.Errorf("%s helper: still running 30s after its stdin closed", h.role)
	}
}

// rss returns the helper's VmRSS in kB.
func (h *helper) rss(b *testing.B) int {
	b.Helper()
	path := fmt.Sprintf("/proc/%d/status", h.cmd.Process.Pid)
	st, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	for _, l := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				b.Fatalf("%s: VmRSS %q: %v", path, v, err)
			}
			return kb
		}
	}
	b.Fatalf("no VmRSS in %s:\n%s", path, st)
	return 0
}

// fds returns how many files the helper has open.
func (h *helper) fds(b *testing.B) int {
	b.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", h.cmd.Process.Pid))
	if err != nil {
		b.Fatal(err)
	}
	return len(ents)
}
