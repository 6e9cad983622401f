package e2e_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/testgate"
)

// runScript is scripts/run.sh (make run) started as a terminal starts a
// job: leading a process group of its own.
type runScript struct {
	t      *testing.T
	cmd    *exec.Cmd
	runDir string
	env    []string

	mu   sync.Mutex
	out  bytes.Buffer // everything the script printed
	done chan struct{}
	err  error // Wait's result, once done is closed
}

// startRunScript starts scripts/run.sh with the built services and the nats
// CLI of ./bin, state in a temporary directory, servers on ports the kernel
// picks, and env added to the environment.
func startRunScript(t *testing.T, env ...string) *runScript {
	t.Helper()
	runDir := t.TempDir()
	return startRunScriptIn(t, runDir, runEnv(t, runDir, env...))
}

// runEnv is the environment of a make run with the built services and the
// nats CLI of ./bin, state in runDir, servers on ports the kernel picks,
// and env added.
func runEnv(t *testing.T, runDir string, env ...string) []string {
	t.Helper()
	needBinaries(t)
	natsCLI, err := filepath.Abs(filepath.Join("..", "bin", "nats"))
	if err != nil {
		t.Fatal(err)
	}
	testgate.NeedFile(t, natsCLI, "the pinned nats CLI (make nats)")
	bin := t.TempDir()
	for _, name := range []string{"planner", "health", "local-agent", "gateway", "console"} {
		if err := os.Symlink(filepath.Join(binDir, name), filepath.Join(bin, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(natsCLI, filepath.Join(bin, "nats")); err != nil {
		t.Fatal(err)
	}
	out := append(os.Environ(),
		"PROXYFLEET_BIN="+bin,
		"PROXYFLEET_RUN_DIR="+runDir,
		"PROXYFLEET_NATS_ADDR=127.0.0.1:0",
		"PROXYFLEET_ECHO_ADDR=127.0.0.1:0",
		"PROXYFLEET_GATEWAY_ADDR=127.0.0.1:0",
		"PROXYFLEET_CONSOLE_ADDR=127.0.0.1:0",
		// Proxy ports from the kernel, and so a capacity (a test's own
		// AGENT_FLAGS replace these).
		"PROXYFLEET_PORTS=0",
		"AGENT_FLAGS=--capacity 5",
		// The nats CLI drops a selected context it cannot find: keep it
		// away from the user's configuration.
		"XDG_CONFIG_HOME="+t.TempDir(),
	)
	// Nothing of the run outlives the test, even when stopping it failed.
	t.Cleanup(func() {
		for pid := range runServices(runDir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return append(out, env...)
}

// startRunScriptIn starts scripts/run.sh with its state in runDir and the
// environment env (from [runEnv]).
func startRunScriptIn(t *testing.T, runDir string, env []string) *runScript {
	t.Helper()
	r := &runScript{t: t, runDir: runDir, env: env, done: make(chan struct{})}
	r.cmd = exec.Command(filepath.Join("..", "scripts", "run.sh"))
	r.cmd.Env = r.env
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	r.cmd.Stderr = r.cmd.Stdout
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		_, _ = io.Copy(r, stdout)
		r.err = r.cmd.Wait()
		close(r.done)
	}()
	t.Cleanup(func() {
		// SIGTERM stops the services in order; the proxies they made are
		// stopped by clean.sh.
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.done:
		case <-time.After(60 * time.Second):
			_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
			<-r.done
		}
		cleanScript(t, "stop", r.runDir)
		if t.Failed() {
			t.Logf("---- run.sh output ----\n%s", r.output())
			for _, name := range []string{"planner", "health", "local-agent", "gateway", "console"} {
				b, _ := os.ReadFile(filepath.Join(r.runDir, "logs", name+".log"))
				if len(b) > 6000 {
					b = b[len(b)-6000:]
				}
				t.Logf("---- %s log (tail) ----\n%s", name, b)
			}
		}
	})
	return r
}

func (r *runScript) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out.Write(p)
}

func (r *runScript) output() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out.String()
}

// waitBanner waits until the script printed its banner, and returns it.
func (r *runScript) waitBanner() string {
	r.t.Helper()
	const end = "Press Ctrl-C to stop."
	deadline := time.After(90 * time.Second)
	for !strings.Contains(r.output(), end) {
		select {
		case <-r.done:
			r.t.Fatalf("run.sh exited before its banner: %v", r.err)
		case <-deadline:
			r.t.Fatal("no banner from run.sh within 90s")
		case <-time.After(50 * time.Millisecond):
		}
	}
	return r.output()
}

// shell runs line with bash in the script's environment (the shell of a
// user who ran make run).
func (r *runScript) shell(line string) (string, error) {
	cmd := exec.Command("bash", "-c", line)
	cmd.Env = r.env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), errors.Join(err, errors.New(stderr.String()))
	}
	return string(out), nil
}

// bannerLine returns the first command line of banner that starts with
// prefix, without its trailing comment.
func bannerLine(t *testing.T, banner, prefix string) string {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(banner))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, prefix) {
			line, _, _ = strings.Cut(line, " # ")
			return strings.TrimSpace(line)
		}
	}
	t.Fatalf("no line starting with %q in the banner:\n%s", prefix, banner)
	return ""
}

// TestRunScript is make run as a newcomer meets it, with NATS_URL and
// NATS_CONTEXT in the shell naming servers that do not exist: the script
// must start its own server all the same, its printed commands must reach
// that server (a pool of 1 gets a ready proxy), make rebuild-views must
// rebuild the views without the script taking health's stop for a crash,
// and Ctrl-C (SIGINT to the script's process group, as a terminal sends it)
// must stop the gateway, the agent, health and the planner in that order and exit 0 with
// one line. make logs shows a request the proxy failed.
func TestRunScript(t *testing.T) {
	r := startRunScript(t,
		"NATS_URL=nats://127.0.0.1:1",
		"NATS_CONTEXT=no-such-context",
		"PLANNER_FLAGS=--reconcile-interval 200ms",
		"HEALTH_FLAGS=--probe-interval 300ms --probe-timeout 2s",
		"AGENT_FLAGS=--target t1 --capacity 5",
	)
	banner := r.waitBanner()

	// The banner's commands, as a user copies them into another shell.
	env := bannerLine(t, banner, ". ")
	apply := bannerLine(t, banner, `nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":1}'`)
	list := bannerLine(t, banner, "nats req fleet.api.proxy.list")
	if out, err := r.shell(env + " && " + apply); err != nil {
		t.Fatalf("%s: %v\n%s", apply, err, out)
	}
	var proxies struct {
		Proxies []proxyView `json:"proxies"`
	}
	waitFor(t, 60*time.Second, "the pool's proxy to be ready", func() bool {
		out, err := r.shell(env + " && " + list)
		if err != nil || json.Unmarshal([]byte(out), &proxies) != nil {
			return false
		}
		return len(proxies.Proxies) == 1 && proxies.Proxies[0].State == "ready"
	})
	events := bannerLine(t, banner, "nats sub --stream FLEET_EVENTS")
	if out, err := r.shell(env + " && " + events + " | grep -c proxyfleet.proxy.ready.v1"); err != nil || strings.TrimSpace(out) != "1" {
		t.Errorf("%s | grep: %q, %v; want one ready event", events, out, err)
	}

	// The server lets in only make run's users, whose credentials only
	// the owner can read.
	checkRunCredentials(t, r)

	// The pass-through flags reached the agent.
	if b, _ := os.ReadFile(filepath.Join(r.runDir, "logs", "local-agent.log")); !bytes.Contains(b, []byte(`"msg":"agent started","service":"local-agent","entry":"local","target":"t1"`)) {
		t.Errorf("local-agent.log has no start as target t1: AGENT_FLAGS did not reach it")
	}

	// A request the proxy refuses leaves its cause in the proxy's log,
	// which make logs shows: loopback is not a destination.
	p := proxies.Proxies[0]
	if code, body, err := getThrough(p.Address, "http://127.0.0.1:1/", nil); err != nil || code != 403 {
		t.Errorf("GET of loopback through %s: %d %q %v, want 403", p.Address, code, body, err)
	}
	logs := exec.Command(filepath.Join("..", "scripts", "logs.sh"), r.runDir)
	out, err := logs.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "== proxy "+p.ID+" of pool demo") ||
		!strings.Contains(string(out), `"msg":"egress denied"`) {
		t.Errorf("logs.sh: %v, want the proxy's refusal under its id\n%s", err, out)
	}

	rebuild := exec.Command(filepath.Join("..", "scripts", "run.sh"), "rebuild-views")
	rebuild.Env = r.env
	if out, err := rebuild.CombinedOutput(); err != nil || !strings.Contains(string(out), "ok: views rebuilt") {
		t.Fatalf("run.sh rebuild-views: %v\n%s", err, out)
	}
	waitFor(t, 30*time.Second, "the rebuilt view to hold the ready proxy", func() bool {
		out, err := r.shell(env + " && nats kv get fleet-proxies " + p.ID + " --raw")
		return err == nil && strings.Contains(out, `"state":"ready"`)
	})

	before := len(r.output())
	if err := syscall.Kill(-r.cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-r.done:
	case <-time.After(60 * time.Second):
		t.Fatal("run.sh still runs 60s after SIGINT")
	}
	after := r.output()[before:]
	if r.err != nil {
		t.Errorf("run.sh after SIGINT: %v, want exit status 0", r.err)
	}
	want := "stopped console, gateway, local-agent, health and planner; proxies keep running (the next make run manages them, make clean-proxies stops them)\n"
	if after != want {
		t.Errorf("run.sh printed after SIGINT:\n%q\nwant one line:\n%q", after, want)
	}
	var stops []time.Time
	for _, s := range []struct{ log, msg string }{
		{"console", "console stopped"}, {"gateway", "gateway stopped"}, {"local-agent", "agent stopped"}, {"health", "health stopped"}, {"planner", "planner stopped"},
	} {
		stops = append(stops, lastLogTime(t, filepath.Join(r.runDir, "logs", s.log+".log"), s.msg))
	}
	if !stops[0].Before(stops[1]) || !stops[1].Before(stops[2]) || !stops[2].Before(stops[3]) || !stops[3].Before(stops[4]) {
		t.Errorf("stopped at %v (console, gateway, agent, health, planner); want that order", stops)
	}
}

// checkRunCredentials checks that make run's NATS server refuses a client
// without credentials (before, any local user or process was a full NATS
// user and could read fleet-secrets) and with a wrong password, that the
// nats CLI of nats.env gets in, and that the credentials are the owner's
// alone: <run-dir>/nats mode 0700, its files 0600.
func checkRunCredentials(t *testing.T, r *runScript) {
	t.Helper()
	env, err := os.ReadFile(filepath.Join(r.runDir, "nats.env"))
	if err != nil {
		t.Fatal(err)
	}
	var url string
	for _, line := range strings.Split(string(env), "\n") {
		if v, ok := strings.CutPrefix(line, "export NATS_URL="); ok {
			url = v
		}
	}
	if url == "" {
		t.Fatalf("nats.env names no NATS_URL:\n%s", env)
	}
	for name, opts := range map[string][]nats.Option{
		"no credentials": nil,
		"wrong password": {nats.UserInfo("operator", "guess")},
		"no password":    {nats.UserInfo("health", "")},
	} {
		nc, err := nats.Connect(url, append(opts, nats.MaxReconnects(0))...)
		if err == nil {
			_, kerr := nc.JetStream()
			nc.Close()
			t.Errorf("make run's NATS server let in a client with %s (%v)", name, kerr)
		} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
			t.Errorf("a client with %s: %v, want an authorization violation", name, err)
		}
	}
	out, err := r.shell(". " + filepath.Join(r.runDir, "nats.env") + " && nats kv ls")
	if err != nil || !strings.Contains(out, "fleet-secrets") {
		t.Errorf("the nats CLI of nats.env lists buckets: %q, %v", out, err)
	}
	dir := filepath.Join(r.runDir, "nats")
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("%s has mode %v, want 0700", dir, fi.Mode().Perm())
	}
	files, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range files {
		names = append(names, f.Name())
		i, err := f.Info()
		if err != nil {
			t.Fatal(err)
		}
		if i.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f.Name(), i.Mode().Perm())
		}
	}
	for _, want := range []string{"server.conf", "operator.json", "health.json", "local-agent.json", "gateway.json"} {
		if !slices.Contains(names, want) {
			t.Errorf("%s holds %v, no %s", dir, names, want)
		}
	}
}

// lastLogTime is the time of the last JSON log line of path whose msg is msg.
func lastLogTime(t *testing.T, path, msg string) time.Time {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var last time.Time
	for _, line := range bytes.Split(b, []byte("\n")) {
		var l struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(line, &l) == nil && l.Msg == msg {
			last = l.Time
		}
	}
	if last.IsZero() {
		t.Fatalf("%s: no %q line", path, msg)
	}
	return last
}
