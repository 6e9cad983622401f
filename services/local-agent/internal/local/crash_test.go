package local

import (
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// agentEnv is what a test of the local-agent binary works with: a bus, an
// origin its proxies may reach, the agent's data directory (its proxies'
// state under stateDir) and ports, and the fleet's event store.
type agentEnv struct {
	conn     *bus.Conn
	o        *httptest.Server
	dataDir  string
	stateDir string
	ports    PortRange
	store    *bus.EventStore
}

// newAgentEnv starts the bus and the origin; every proxy left in the state
// directory is stopped when the test ends.
func newAgentEnv(t *testing.T) agentEnv {
	t.Helper()
	conn := bustest.Start(t)
	dataDir := t.TempDir()
	e := agentEnv{
		conn:     conn,
		o:        origin(t),
		dataDir:  dataDir,
		stateDir: filepath.Join(dataDir, "proxies"),
		ports:    testPorts(),
		store:    bus.NewEventStore(conn, "test", nil),
	}
	t.Cleanup(func() {
		if d, err := New(Config{StateDir: e.stateDir, Ports: e.ports, Executable: agentBin}, nil); err == nil {
			cleanupAll(t, d)
		}
	})
	return e
}

// agentCommand is the local-agent binary's command line against e's bus,
// data directory and ports, its egress allowing e's origin, with more
// flags added.
func (e agentEnv) agentCommand(t *testing.T, more ...string) *exec.Cmd {
	t.Helper()
	return exec.Command(agentBin, append([]string{
		"--nats-url", e.conn.ClientURL(),
		"--data-dir", e.dataDir, "--ports", e.ports.String(), "--target", testTarget, "--egress-allow", endpoint(t, e.o).String()}, more...)...)
}

// startAgentProcess runs the built local-agent binary and returns the
// running command; its output goes to logName in the data directory. more
// are flags added to [agentEnv.agentCommand]'s.
func (e agentEnv) startAgentProcess(t *testing.T, logName string, more ...string) *exec.Cmd {
	t.Helper()
	logf, err := os.Create(filepath.Join(e.dataDir, logName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() })
	cmd := e.agentCommand(t, more...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		}
	})
	return cmd
}

// TestAgentKilledWhileCreating kills the agent process with SIGKILL in the
// middle of a create (as soon as it reports provisioning, or as soon as the
// proxy's state file appears), starts it again, and expects exactly one
// proxy process for the proxy, reported running, and nothing else.
func TestAgentKilledWhileCreating(t *testing.T) {
	cases := []struct {
		name string
		// killWhen holds once the agent is far enough into the create.
		killWhen func(store *bus.EventStore, stateFile string) bool
	}{
		{"at provisioning", func(store *bus.EventStore, _ string) bool {
			last, err := store.Last(context.Background(), events.AggregateProxy, "demo-crash")
			return err == nil && last != nil
		}},
		{"at state file", func(_ *bus.EventStore, stateFile string) bool {
			_, err := os.Stat(stateFile)
			return err == nil
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { testKilledWhileCreating(t, tc.killWhen) })
	}
}

func testKilledWhileCreating(t *testing.T, killWhen func(*bus.EventStore, string) bool) {
	e := newAgentEnv(t)
	ctx := ctxT(t)
	t.Cleanup(func() {
		if t.Failed() {
			dumpLogs(t, e.dataDir)
		}
	})

	first := e.startAgentProcess(t, "agent-1.log")
	cmd := createCommand("demo-crash", nil)
	if _, err := bus.PublishCreate(ctx, e.conn, "test", cmd, 0); err != nil {
		t.Fatal(err)
	}
	stateFile := filepath.Join(e.stateDir, cmd.Instance+".json")
	eventually(t, "the agent to reach the kill point", func() bool { return killWhen(e.store, stateFile) })
	if err := first.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()

	e.startAgentProcess(t, "agent-2.log")
	addr := waitRunning(t, e.store, cmd.ProxyID)
	wantServes(t, addr, e.o)

	d, err := New(Config{StateDir: e.stateDir, Ports: e.ports, Executable: agentBin}, nil)
	if err != nil {
		t.Fatal(err)
	}
	list, err := d.List(ctx)
	if err != nil || len(list) != 1 || list[0].Name != cmd.Instance || list[0].Address != addr {
		t.Fatalf("state after the crash: %+v, %v; want exactly %s at %s", list, err, cmd.Instance, addr)
	}
	s := readState(t, d, cmd.Instance)
	leaders, all := markedProcesses(d.states.path(cmd.Instance))
	if len(leaders) != 1 || len(all) != 1 || leaders[0] != s.PID || !alive(s.PID, s.StartTime) {
		t.Fatalf("proxy processes %v (all %v), state pid %d; want exactly the recorded one", leaders, all, s.PID)
	}
	got, err := d.Get(ctx, agent.Ref{Name: cmd.Instance})
	if err != nil || got.State != agent.StateRunning {
		t.Fatalf("Get = %+v, %v; want running", got, err)
	}
	if n := countMarked(t, e.stateDir); n != 1 {
		t.Fatalf("%d proxy processes carry this state directory's marker, want 1", n)
	}
	evs, _ := e.store.Load(ctx, events.AggregateProxy, cmd.ProxyID)
	running := 0
	for _, ev := range evs {
		if ev.Kind == events.ProxyRunning {
			running++
		}
	}
	if running != 1 {
		t.Fatalf("%d running events, want 1", running)
	}
}

// countMarked counts live session leaders whose marker points into dir.
func countMarked(t *testing.T, dir string) int {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		if filepath.Ext(e.Name()) == ".json" {
			leaders, _ := markedProcesses(filepath.Join(dir, e.Name()))
			n += len(leaders)
		}
	}
	return n
}

func dumpLogs(t *testing.T, dir string) {
	for _, n := range []string{"agent-1.log", "agent-2.log"} {
		b, _ := os.ReadFile(filepath.Join(dir, n))
		t.Logf("%s:\n%s", n, b)
	}
}

// A Ctrl-C in the agent's terminal signals the agent's whole process group;
// proxies run in their own session and must keep serving.
func TestProxiesSurviveInterruptOfAgentGroup(t *testing.T) {
	e := newAgentEnv(t)
	ctx := ctxT(t)
	agentCmd := e.agentCommand(t)
	agentCmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the "terminal's" process group
	if err := agentCmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd := createCommand("demo-sigint", nil)
	addr := createRunning(ctx, t, e.conn, e.store, cmd)
	if err := syscall.Kill(-agentCmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if err := agentCmd.Wait(); err != nil {
		t.Fatalf("agent after SIGINT: %v, want a clean exit", err)
	}
	wantServes(t, addr, e.o)
}
