package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// binDir holds the service binaries built once for the package.
var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "proxyfleet-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	killBinaryProcesses(filepath.Join(dir, "local-agent"))
	os.RemoveAll(dir)
	os.Exit(code)
}

var (
	buildOnce sync.Once
	buildErr  error
)

// needBinaries builds the service binaries once for the package.
func needBinaries(t *testing.T) {
	t.Helper()
	buildOnce.Do(func() {
		for _, svc := range []string{"planner", "health", "local-agent", "gateway", "console"} {
			if err := goBuild(filepath.Join(binDir, svc), "-tags", serviceTags, "proxyfleet/services/"+svc+"/cmd/"+svc); err != nil {
				buildErr = fmt.Errorf("build %s: %v", svc, err)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
}

// fleet is one running system: a JetStream server in the test process and
// the three services as child processes connected to it.
type fleet struct {
	t        *testing.T
	conn     *bus.Conn
	api      *api.Client // the planner's API on conn
	dir      string
	echoAddr string
	agentArg []string
	stateDir string // the local-agent's state directory
	storeDir string // the JetStream server's store directory
	squid    string // squid binary when the agent runs Squid proxies

	mu    sync.Mutex
	procs map[string]*exec.Cmd
}

func newFleet(t *testing.T, agentArgs ...string) *fleet {
	t.Helper()
	needBinaries(t)
	// Squid drops to its own user, which must reach the state directory, so
	// it lives in a world-searchable directory rather than under TempDir.
	stateDir, err := os.MkdirTemp("", "proxyfleet-e2e-state-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(stateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	storeDir := t.TempDir()
	f := &fleet{
		stateDir: stateDir,
		storeDir: storeDir,
		t:        t,
		conn:     bustest.StartIn(t, storeDir),
		dir:      t.TempDir(),
		// Health listens where the kernel puts it and probes through the
		// address it bound.
		echoAddr: "127.0.0.1:0",
		agentArg: agentArgs,
		procs:    map[string]*exec.Cmd{},
	}
	f.api = api.NewClient(f.conn.NC, api.WithTimeout(5*time.Second))
	t.Cleanup(func() {
		f.mu.Lock()
		names := make([]string, 0, len(f.procs))
		for n := range f.procs {
			names = append(names, n)
		}
		f.mu.Unlock()
		for _, n := range names {
			f.stop(n)
		}
	})
	return f
}

func (f *fleet) start(name string, args ...string) {
	f.t.Helper()
	f.startBinary(name, filepath.Join(binDir, name), nil, args...)
}

// startBinary starts bin as the fleet's process name with the extra
// environment env, connected to the fleet's NATS, logging to <name>.log;
// the fleet's cleanup stops it.
func (f *fleet) startBinary(name, bin string, env []string, args ...string) *exec.Cmd {
	f.t.Helper()
	common := []string{"--nats-url", f.conn.ClientURL(), "--data-dir", filepath.Join(f.dir, name), "--log-level", "debug"}
	return f.startBinaryArgs(name, bin, env, append(common, args...))
}

// startBinaryArgs starts bin with exactly args and, unless nil, the extra
// environment env, logging to <name>.log; the fleet's cleanup stops it.
func (f *fleet) startBinaryArgs(name, bin string, env, args []string) *exec.Cmd {
	f.t.Helper()
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	logf, err := os.OpenFile(filepath.Join(f.dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		f.t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		f.t.Fatalf("start %s: %v", name, err)
	}
	f.mu.Lock()
	f.procs[name] = cmd
	f.mu.Unlock()
	return cmd
}

func (f *fleet) startPlanner() { f.start("planner", "--reconcile-interval", "200ms") }
func (f *fleet) startHealth() {
	f.start("health", "--echo-addr", f.echoAddr, "--probe-interval", "300ms", "--probe-timeout", "2s")
}
func (f *fleet) startAgent() {
	// The proxies refuse loopback: the probes' echo endpoint is allowed
	// explicitly, as make run does.
	args := []string{"--entry", "local", "--target", "t1", "--state-dir", f.stateDir, "--egress-allow", f.echoEndpoint()}
	if f.squid != "" {
		// Squid binds the port its configuration names: the agent's
		// default range, whose busy ports it skips.
		args = append(args, "--squid", f.squid)
	} else {
		// The kernel chooses each proxy's port; the agent hands the bound
		// socket to the proxy.
		args = append(args, "--ports", "0", "--capacity", "40")
	}
	f.start("local-agent", append(args, f.agentArg...)...)
}

// newSquidFleet is newFleet with every proxy a real Squid process. The
// Squid tier (make test-e2e-squid) installs Debian's squid and sets
// PROXYFLEET_SQUID; without it the test is skipped.
func newSquidFleet(t *testing.T) *fleet {
	t.Helper()
	squid := os.Getenv("PROXYFLEET_SQUID")
	if squid == "" {
		t.Skip("PROXYFLEET_SQUID is not set; make test-e2e-squid runs this test with Debian's squid")
	}
	testgate.NeedFile(t, squid, "install Debian's squid (make squid-install)")
	f := newFleet(t)
	f.squid = squid
	return f
}

// echoServing finds the address of health's echo endpoint in its log.
var echoServing = regexp.MustCompile(`"msg":"echo endpoint serving"[^\n]*?"addr":"([^"]+)"`)

// echoEndpoint waits until health reports where its echo endpoint listens
// (the kernel chose the port) and returns that ip:port.
func (f *fleet) echoEndpoint() string {
	f.t.Helper()
	var addr string
	waitFor(f.t, 30*time.Second, "health's echo endpoint", func() bool {
		m := echoServing.FindAllStringSubmatch(f.log("health"), -1)
		if len(m) == 0 {
			return false
		}
		addr = m[len(m)-1][1]
		return true
	})
	return addr
}

// startFleet is a new fleet with every service started, its proxies
// allowed to reach the test's servers among allowed (which are on
// loopback, where proxies reach nothing else), whose logs the test shows
// if it fails.
func startFleet(t *testing.T, allowed ...*httptest.Server) *fleet {
	t.Helper()
	f := newFleet(t)
	for _, srv := range allowed {
		f.allow(srv)
	}
	f.dumpLogsOnFailure()
	f.startAll()
	return f
}

func (f *fleet) startAll() {
	f.startPlanner()
	f.startHealth()
	f.startAgent()
	f.waitAgent("local", "t1")
	f.waitLeader()
}

// waitLeader waits until a planner has opened a leader term, so that the
// term event is in the log before a test counts events.
func (f *fleet) waitLeader() {
	f.t.Helper()
	store := bus.NewEventStore(f.conn, "e2e", nil)
	waitFor(f.t, 30*time.Second, "a planner to lead", func() bool {
		cur, err := store.CurrentTerm(context.Background())
		return err == nil && cur != nil
	})
}

// stop ends a service with SIGTERM and waits for it.
func (f *fleet) stop(name string) {
	f.mu.Lock()
	cmd := f.procs[name]
	delete(f.procs, name)
	f.mu.Unlock()
	if cmd == nil {
		return
	}
	testwait.Stop(cmd, syscall.SIGTERM, 15*time.Second)
}

// kill9 ends a service with SIGKILL, as a crash would.
func (f *fleet) kill9(name string) {
	f.mu.Lock()
	cmd := f.procs[name]
	delete(f.procs, name)
	f.mu.Unlock()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

func (f *fleet) log(name string) string {
	b, _ := os.ReadFile(filepath.Join(f.dir, name+".log"))
	return string(b)
}

// dumpLogs shows the services' logs when the test failed.
func (f *fleet) dumpLogsOnFailure() {
	f.t.Cleanup(func() {
		if !f.t.Failed() {
			return
		}
		for _, n := range []string{"planner", "health", "local-agent"} {
			l := f.log(n)
			if len(l) > 6000 {
				l = l[len(l)-6000:]
			}
			f.t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})
}

type apiReply struct {
	Data []byte
	Code string // micro error code, "" on success
}

// retry calls fn until a planner answers it (the planner may still be
// starting): the reply or the refusal fn returns.
func retry[T any](t *testing.T, what string, fn func(context.Context) (T, error)) (T, error) {
	t.Helper()
	var out T
	var err error
	for range 50 {
		out, err = fn(context.Background())
		if !errors.Is(err, api.ErrNoReply) {
			return out, err
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: %v", what, err)
	return out, err
}

// req sends body as it is to subject, in the trace hdr carries (nil: none).
func (f *fleet) req(subject, body string, hdr nats.Header) apiReply {
	f.t.Helper()
	raw, err := retry(f.t, "request "+subject, func(ctx context.Context) (json.RawMessage, error) {
		var raw json.RawMessage
		err := f.api.Request(telemetry.Extract(ctx, hdr), subject, []byte(body), &raw)
		return raw, err
	})
	var aerr *api.APIError
	switch {
	case err == nil:
		return apiReply{Data: raw}
	case !errors.As(err, &aerr):
		f.t.Fatalf("request %s: %v", subject, err)
	}
	return apiReply{Data: api.ErrorBody(aerr), Code: aerr.Status}
}

// must is the reply of a request that must succeed.
func must[T any](t *testing.T, what string, fn func(context.Context) (T, error)) T {
	t.Helper()
	out, err := retry(t, what, fn)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return out
}

// apply applies spec, which must be accepted.
func (f *fleet) apply(spec events.PoolSpec) api.PoolView {
	f.t.Helper()
	return must(f.t, "pool.apply "+spec.Name, func(ctx context.Context) (api.PoolView, error) { return f.api.PoolApply(ctx, spec) })
}

// deletePool deletes pool name, which must be accepted.
func (f *fleet) deletePool(name string) {
	f.t.Helper()
	must(f.t, "pool.delete "+name, func(ctx context.Context) (api.PoolView, error) { return f.api.PoolDelete(ctx, name) })
}

// deletePoolAndWait deletes pool name and waits until it has no proxy left,
// in the views and as processes.
func (f *fleet) deletePoolAndWait(name string) {
	f.t.Helper()
	f.deletePool(name)
	waitFor(f.t, 60*time.Second, "pool "+name+" to be empty", func() bool {
		return len(f.proxies(name)) == 0 && len(f.proxyProcs()) == 0
	})
}

func (f *fleet) waitAgent(entry, target string) {
	f.t.Helper()
	kv, err := f.conn.JS.KeyValue(context.Background(), bus.BucketAgents)
	if err != nil {
		f.t.Fatal(err)
	}
	waitFor(f.t, 30*time.Second, "agent heartbeat", func() bool {
		_, err := kv.Get(context.Background(), entry+"."+target)
		return err == nil
	})
}

// proxyView is the part of a fleet-proxies value the tests read.
type proxyView struct {
	ID      string `json:"id"`
	Pool    string `json:"pool"`
	State   string `json:"state"`
	Address string `json:"address"`
}

// views reads every key of bucket. A read that fails is tried again for
// up to 30 s: on a cluster, a node's loss leaves JetStream unavailable
// while its groups elect leaders.
func (f *fleet) views(bucket string) map[string][]byte {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := f.readViews(bucket)
		if err == nil {
			return out
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("read %s: %v", bucket, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (f *fleet) readViews(bucket string) (map[string][]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := f.conn.JS.KeyValue(ctx, bucket)
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return nil, err
	}
	for k := range keys.Keys() {
		e, err := kv.Get(ctx, k)
		if err == nil {
			out[k] = e.Value()
		}
	}
	return out, nil
}

func (f *fleet) proxies(pool string) []proxyView {
	f.t.Helper()
	var out []proxyView
	for _, raw := range f.views(bus.BucketProxies) {
		var v proxyView
		if err := json.Unmarshal(raw, &v); err != nil {
			f.t.Fatalf("fleet-proxies value is not JSON: %s", raw)
		}
		if v.Pool == pool {
			out = append(out, v)
		}
	}
	return out
}

// waitPool waits until pool has exactly n proxies in fleet-proxies, all in
// state.
func (f *fleet) waitPool(pool string, n int, state string, within time.Duration) []proxyView {
	f.t.Helper()
	var got []proxyView
	waitFor(f.t, within, fmt.Sprintf("%d %s proxies in pool %s", n, state, pool), func() bool {
		got = f.proxies(pool)
		if len(got) != n {
			return false
		}
		for _, p := range got {
			if p.State != state {
				return false
			}
		}
		return true
	})
	return got
}

// streamState is the state of stream now.
func (f *fleet) streamState(stream string) jetstream.StreamState {
	f.t.Helper()
	s, err := f.conn.JS.Stream(context.Background(), stream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	return info.State
}

func (f *fleet) lastSeq(stream string) uint64 {
	f.t.Helper()
	return f.streamState(stream).LastSeq
}

// eventCount counts FLEET_EVENTS messages on subjects matching filter.
// intentEvents counts the events a request can append: proxy events and
// pools' applied and deleted events. The leader's own bookkeeping (terms,
// fences, pool conditions) is left out, so "a refused request appended
// nothing" does not race it.
func (f *fleet) intentEvents() uint64 {
	f.t.Helper()
	return f.eventCount("fleet.evt.proxy.>") + f.eventCount("fleet.evt.pool.*.applied") + f.eventCount("fleet.evt.pool.*.deleted")
}

func (f *fleet) eventCount(filter string) uint64 {
	f.t.Helper()
	_, n := f.subjectCount(filter)
	return n
}

// subjectCount returns how many subjects of FLEET_EVENTS match filter and
// how many messages they hold.
func (f *fleet) subjectCount(filter string) (int, uint64) {
	f.t.Helper()
	s, err := f.conn.JS.Stream(context.Background(), bus.EventsStream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(filter))
	if err != nil {
		f.t.Fatal(err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return len(info.State.Subjects), n
}

// waitFor is [testwait.Until], under the name every e2e test uses.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, within, what, cond)
}

// origin is a local HTTP server the tests reach through the proxies.
func origin(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello through "+r.Header.Get("X-Probe"))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// getThrough does a plain-HTTP GET of target through the proxy at addr.
// allow has the agent's proxies reach srv on loopback (the agent's
// --egress-allow); call it before the agent starts.
func (f *fleet) allow(srv *httptest.Server) {
	f.agentArg = append(f.agentArg, "--egress-allow", srv.Listener.Addr().String())
}

func getThrough(addr, target string, user *url.Userinfo) (int, string, error) {
	pu := &url.URL{Scheme: "http", Host: addr, User: user}
	tr := &http.Transport{Proxy: http.ProxyURL(pu), DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	req, _ := http.NewRequest(http.MethodGet, target, nil)
	req.Header.Set("X-Probe", addr)
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// proxyProcesses lists live processes running exe with "proxy" as their
// first argument (the local-agent's proxy subcommand) whose working
// directory is under dir (each runs in its instance's directory of the
// agent's state directory; empty means any).
func proxyProcesses(exe, dir string) []int {
	return processesOf(exe, func(pid int, cmdline []byte) bool {
		args := bytes.Split(cmdline, []byte{0})
		return len(args) > 1 && string(args[1]) == "proxy" && runsIn(pid, dir)
	})
}

// processesOf lists the live processes (zombies left out) running exe for
// which match, given the pid and the NUL-separated command line, holds.
func processesOf(exe string, match func(pid int, cmdline []byte) bool) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || p != exe {
			continue
		}
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if match(pid, cmdline) && !isZombie(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// runsIn reports whether pid's working directory is dir or below it.
func runsIn(pid int, dir string) bool {
	if dir == "" {
		return true
	}
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real // the kernel reports the resolved path
	}
	cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
	return err == nil && (cwd == dir || strings.HasPrefix(cwd, dir+string(filepath.Separator)))
}

// listenPort returns the port of a proxy command line's --listen address,
// or "".
func listenPort(args [][]byte) string {
	for i, a := range args {
		v := string(a)
		switch {
		case strings.HasPrefix(v, "--listen="):
			v = strings.TrimPrefix(v, "--listen=")
		case v == "--listen" && i+1 < len(args):
			v = string(args[i+1])
		default:
			continue
		}
		if _, p, err := net.SplitHostPort(v); err == nil {
			return p
		}
		return ""
	}
	return ""
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z'
}

// killBinaryProcesses removes every process left running exe, so a failed
// test leaves nothing behind.
func killBinaryProcesses(exe string) {
	for _, pid := range proxyProcesses(exe, "") {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

func agentExe() string { return filepath.Join(binDir, "local-agent") }

// proxyProcs lists the live proxy processes of this fleet: built-in proxy
// processes running in its state directory, or Squid processes reading their
// configuration from its state directory.
func (f *fleet) proxyProcs() []int {
	if f.squid == "" {
		return proxyProcesses(agentExe(), f.stateDir)
	}
	return processesOf(f.squid, func(_ int, cmdline []byte) bool {
		return bytes.Contains(cmdline, []byte(f.stateDir))
	})
}
