package e2e_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// cleanScript runs scripts/clean.sh mode runDir and returns its exit code
// and output.
func cleanScript(t *testing.T, mode, runDir string) (int, string) {
	t.Helper()
	cmd := exec.Command(filepath.Join("..", "scripts", "clean.sh"), mode, runDir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String()
	case errors.As(err, &ee):
		return ee.ExitCode(), out.String()
	}
	t.Fatalf("clean.sh %s: %v\n%s", mode, err, out.String())
	return 0, ""
}

// TestCleanRefusesWhileProxiesRun: `clean.sh check` (make clean) refuses
// while the services of a run still run, naming them. After they stop, the
// proxy processes they made keep running; the check refuses, naming each
// instance and how to delete it, and `clean.sh stop`
// (make clean-proxies) stops them and removes their state, after which the
// check passes. A state file whose pid now belongs to another process (pid
// reuse: the start time differs) is never taken for a proxy, nor signalled.
func TestCleanRefusesWhileProxiesRun(t *testing.T) {
	f := newFleet(t)
	f.dumpLogsOnFailure()
	runDir := t.TempDir()
	f.dir = runDir // the services' data directories, as make run lays them out
	f.stateDir = filepath.Join(runDir, "local-agent", "proxies")
	if err := os.MkdirAll(f.stateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // nothing left behind on failure
		for _, name := range []string{"planner", "health", "local-agent"} {
			f.stop(name)
		}
		cleanScript(t, "stop", runDir)
	})

	if code, out := cleanScript(t, "check", runDir); code != 0 {
		t.Fatalf("check of an empty run: exit %d, want 0\n%s", code, out)
	}
	f.startAll()
	f.apply(events.PoolSpec{Name: "left", Provider: "local", Size: 2})
	ready := f.waitPool("left", 2, "ready", 60*time.Second)

	// While the services run, their state must stay.
	code, out := cleanScript(t, "check", runDir)
	if code != 1 || !strings.Contains(out, "refusing to clean: services of make run still run") {
		t.Fatalf("check with the services running: exit %d, want 1 naming them\n%s", code, out)
	}
	if code, stopOut := cleanScript(t, "stop", runDir); code != 1 || !strings.Contains(stopOut, "refusing to stop proxies: services of make run still run") {
		t.Fatalf("stop with the services running: exit %d, want 1\n%s", code, stopOut)
	}
	if n := len(f.proxyProcs()); n != 2 {
		t.Fatalf("proxy processes after a refused stop: %d, want 2", n)
	}
	for _, name := range []string{"planner", "health", "local-agent"} {
		f.mu.Lock()
		pid := f.procs[name].Process.Pid
		f.mu.Unlock()
		if want := fmt.Sprintf("  %s (pid %d)\n", name, pid); !strings.Contains(out, want) {
			t.Errorf("check output lacks %q:\n%s", want, out)
		}
	}
	for _, name := range []string{"planner", "health", "local-agent"} {
		f.stop(name)
	}
	procs := f.proxyProcs()
	if len(procs) != 2 {
		t.Fatalf("proxy processes after the services stopped: %v, want 2", procs)
	}

	// A stale state file naming a live process that is not a proxy.
	other := exec.Command("sleep", "120")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	stale := fmt.Sprintf(`{
  "kind": "proxyfleet.local.v1",
  "name": "px-staleaaaaaaaaaaaa",
  "marker": {
    "proxyID": "left-stale00000",
    "pool": "left",
    "entry": "local"
  },
  "bind": "127.0.0.1",
  "port": 1,
  "mode": "builtin",
  "pid": %d,
  "startTime": 1
}
`, other.Process.Pid)
	if err := os.WriteFile(filepath.Join(f.stateDir, "px-staleaaaaaaaaaaaa.json"), []byte(stale), 0o644); err != nil {
		t.Fatal(err)
	}

	// A process of an instance whose state was never recorded (a crash
	// between start and record) is found by its environment.
	unrecorded := exec.Command("sleep", "120")
	unrecorded.Env = []string{"PROXYFLEET_INSTANCE=" + filepath.Join(f.stateDir, "px-unrecordedaaaaa.json")}
	unrecorded.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := unrecorded.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unrecorded.Process.Kill(); _ = unrecorded.Wait() })

	code, out = cleanScript(t, "check", runDir)
	if code != 1 {
		t.Fatalf("check with 3 instances running: exit %d, want 1\n%s", code, out)
	}
	if want := fmt.Sprintf("  px-unrecordedaaaaa  (no state file)  pid %d\n", unrecorded.Process.Pid); !strings.Contains(out, want) {
		t.Errorf("check output lacks %q:\n%s", want, out)
	}
	for _, p := range ready {
		name := events.InstanceName(p.ID)
		if !strings.Contains(out, name+"  proxy "+p.ID+"  pool left  ") {
			t.Errorf("check output does not list %s of proxy %s:\n%s", name, p.ID, out)
		}
	}
	for _, want := range []string{"refusing to clean: 3 proxy instance(s)", `fleet.api.pool.delete '{"name":"<pool>"}'`, "(left)", "make clean-proxies"} {
		if !strings.Contains(out, want) {
			t.Errorf("check output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "px-staleaaaaaaaaaaaa") {
		t.Errorf("check listed the stale state file:\n%s", out)
	}

	code, out = cleanScript(t, "stop", runDir)
	if code != 0 || !strings.Contains(out, "stopped 3 proxy instance(s)") {
		t.Fatalf("stop: exit %d, want 0 and 3 stopped\n%s", code, out)
	}
	if !isZombie(unrecorded.Process.Pid) {
		t.Errorf("the unrecorded instance's process %d still runs after stop", unrecorded.Process.Pid)
	}
	if left := f.proxyProcs(); len(left) != 0 {
		t.Errorf("proxy processes after stop: %v, want none", left)
	}
	for _, p := range ready {
		name := events.InstanceName(p.ID)
		for _, path := range []string{filepath.Join(f.stateDir, name+".json"), filepath.Join(f.stateDir, name)} {
			if _, err := os.Stat(path); !os.IsNotExist(err) {
				t.Errorf("%s after stop: %v, want it removed", path, err)
			}
		}
	}
	if err := other.Process.Signal(syscall.Signal(0)); err != nil || isZombie(other.Process.Pid) {
		t.Errorf("the unrelated process named by the stale state file was signalled: %v (zombie: %v)", err, isZombie(other.Process.Pid))
	}
	if code, out := cleanScript(t, "check", runDir); code != 0 {
		t.Errorf("check after stop: exit %d, want 0\n%s", code, out)
	}
}
