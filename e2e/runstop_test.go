package e2e_test

import (
	"bytes"
	"fmt"
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
	"unsafe"

	"proxyfleet/pkg/testgate"
)

// The tests of this file stop make run as its users do: Ctrl-C typed into
// the terminal it runs in, with its output on that terminal, in a file or
// in a pipe; closing that terminal; SIGTERM or SIGKILL to its script; and a
// second make run after a crash. After each, nothing of the run may be left:
// no service with its state in the run directory, and no make or script in
// the terminal's session.

// terminal is an interactive bash on a pseudo-terminal, as a terminal
// emulator starts one: the leader of a session whose controlling terminal
// it is, with job control. What is typed goes to the terminal's master, as
// keystrokes do, so Ctrl-C is the line discipline's SIGINT to the
// foreground process group.
type terminal struct {
	t      *testing.T
	master *os.File
	shell  *exec.Cmd
	repo   string // the repository
	dir    string // the shell's working directory, which holds run.log

	mu   sync.Mutex
	out  bytes.Buffer // everything the terminal showed
	done chan struct{}
}

// startTerminal starts bash on a new pseudo-terminal with env.
func startTerminal(t *testing.T, env []string) *terminal {
	t.Helper()
	testgate.NeedBinary(t, "make", "make run is started with make (Debian package make)")
	master, slave := openPTY(t)
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	term := &terminal{t: t, master: master, repo: repo, dir: repo, done: make(chan struct{})}
	term.shell = exec.Command("bash", "--norc", "--noprofile", "-i")
	term.shell.Dir = repo
	term.shell.Env = append(append([]string{}, env...), "PS1=$ ", "HISTFILE=/dev/null", "TERM=dumb")
	term.shell.Stdin, term.shell.Stdout, term.shell.Stderr = slave, slave, slave
	term.shell.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := term.shell.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			term.mu.Lock()
			term.out.Write(buf[:n])
			term.mu.Unlock()
			if err != nil {
				break
			}
		}
		_ = term.shell.Wait()
		close(term.done)
	}()
	t.Cleanup(func() {
		// Whatever the test left: the shell and its session go.
		for _, pid := range sessionProcesses(term.shell.Process.Pid) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		master.Close()
		select {
		case <-term.done:
		case <-time.After(10 * time.Second):
		}
		if t.Failed() {
			t.Logf("---- terminal ----\n%s", term.output())
		}
	})
	return term
}

// openPTY opens a new pseudo-terminal's master and slave.
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	// Non-blocking, so the master is read through Go's poller and Close
	// ends a pending Read: a read blocked in the kernel would hold the file
	// open, and the terminal would never hang up.
	fd, err := syscall.Open("/dev/ptmx", syscall.O_RDWR|syscall.O_NOCTTY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	master = os.NewFile(uintptr(fd), "/dev/ptmx")
	var unlock int32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, master.Fd(), syscall.TIOCSPTLCK, uintptr(unsafe.Pointer(&unlock))); errno != 0 {
		t.Fatalf("unlocking the pseudo-terminal: %v", errno)
	}
	var n uint32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, master.Fd(), syscall.TIOCGPTN, uintptr(unsafe.Pointer(&n))); errno != 0 {
		t.Fatalf("numbering the pseudo-terminal: %v", errno)
	}
	slave, err = os.OpenFile("/dev/pts/"+strconv.Itoa(int(n)), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	return master, slave
}

func (term *terminal) output() string {
	term.mu.Lock()
	defer term.mu.Unlock()
	return term.out.String()
}

// typeKeys writes s to the terminal as keystrokes.
func (term *terminal) typeKeys(s string) {
	term.t.Helper()
	if _, err := term.master.Write([]byte(s)); err != nil {
		term.t.Fatalf("typing %q: %v", s, err)
	}
}

// makeExited matches the line the shell prints when make returns (typed
// after the make command, so the echo of the typing does not match).
var makeExited = regexp.MustCompile(`make exited ([0-9]+)`)

// makeRun types `make run` followed by output (a redirection or a pipe, or
// nothing) and then a report of make's exit status, and waits for the
// banner. make runs the script as the Makefile's run target does, without
// building: the services were built for the package.
func (term *terminal) makeRun(output string) {
	term.t.Helper()
	mk := filepath.Join(term.t.TempDir(), "Makefile")
	if err := os.WriteFile(mk, []byte("run:\n\t@"+filepath.Join(term.repo, "scripts", "run.sh")+"\n"), 0o644); err != nil {
		term.t.Fatal(err)
	}
	term.typeKeys(fmt.Sprintf("make -f %s run %s; echo make exited ${PIPESTATUS[0]}\n", mk, output))
	waitFor(term.t, 90*time.Second, "make run's banner", func() bool {
		return makeExited.MatchString(term.output()) || strings.Contains(term.output()+term.runLog(), "Press Ctrl-C to stop.")
	})
	if makeExited.MatchString(term.output()) {
		term.t.Fatalf("make returned before the banner:\n%s", term.runLog())
	}
}

// procStat is what the tests read of /proc/<pid>/stat.
type procStat struct {
	state   string
	session int
}

// readStat reads /proc/<pid>/stat; ok is false for a process that is gone.
func readStat(pid int) (procStat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	// The command name may hold spaces and parentheses: fields start after
	// the last ')'. They are then state, ppid, pgrp, session.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 4 {
		return procStat{}, false
	}
	sid, _ := strconv.Atoi(f[3])
	return procStat{state: f[0], session: sid}, true
}

// alive reports whether pid runs (a zombie has exited).
func alive(pid int) bool {
	st, ok := readStat(pid)
	return ok && st.state != "Z" && st.state != "X"
}

// processes lists the live pids of /proc.
func processes() []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && alive(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// sessionProcesses lists the live processes of session sid.
func sessionProcesses(sid int) []int {
	var pids []int
	for _, pid := range processes() {
		if st, ok := readStat(pid); ok && st.session == sid {
			pids = append(pids, pid)
		}
	}
	return pids
}

// runServices maps the pid of every live process started with --data-dir
// <runDir>/<service> to its command line: make run's services, found
// without the script's help.
func runServices(runDir string) map[int]string {
	want, err := filepath.EvalSymlinks(runDir)
	if err != nil {
		return nil
	}
	found := map[int]string{}
	for _, pid := range processes() {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
		for i, a := range args {
			dir, ok := strings.CutPrefix(a, "--data-dir=")
			if a == "--data-dir" && i+1 < len(args) {
				dir, ok = args[i+1], true
			}
			if !ok {
				continue
			}
			if !filepath.IsAbs(dir) {
				cwd, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd")
				dir = filepath.Join(cwd, dir)
			}
			if parent, err := filepath.EvalSymlinks(filepath.Dir(dir)); err == nil && parent == want {
				found[pid] = strings.Join(args, " ")
			}
		}
	}
	return found
}

// servicePids returns the pid of each of make run's five services, failing
// unless each runs exactly once.
func servicePids(t *testing.T, runDir string) map[string]int {
	t.Helper()
	pids := map[string]int{}
	for pid, cmdline := range runServices(runDir) {
		name := filepath.Base(strings.Fields(cmdline)[0])
		if _, dup := pids[name]; dup {
			t.Fatalf("two %s processes with their state in %s", name, runDir)
		}
		pids[name] = pid
	}
	if len(pids) != 5 {
		t.Fatalf("services with their state in %s: %v, want planner, health, local-agent, gateway and console", runDir, pids)
	}
	return pids
}

// scriptPid is the pid in <runDir>/run.pid: the script that started the
// services.
func scriptPid(t *testing.T, runDir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(runDir, "run.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("run.pid: %v", err)
	}
	return pid
}

// waitNothingLeft waits until no service of runDir runs and, when sid is
// not 0, nothing but the shell (pid sid) is left of the terminal's session.
func waitNothingLeft(t *testing.T, runDir string, sid int) {
	t.Helper()
	left := func() []string {
		var what []string
		for pid, cmdline := range runServices(runDir) {
			what = append(what, fmt.Sprintf("%d %s", pid, cmdline))
		}
		if sid != 0 {
			for _, pid := range sessionProcesses(sid) {
				if pid == sid {
					continue
				}
				b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
				what = append(what, fmt.Sprintf("%d %s", pid, bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
			}
		}
		return what
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		what := left()
		if len(what) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("60s later, still running:\n  %s", strings.Join(what, "\n  "))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// runLog is what make run wrote to run.log in the terminal's directory
// (the redirections of the tests write there).
func (term *terminal) runLog() string {
	b, _ := os.ReadFile(filepath.Join(term.dir, "run.log"))
	return string(b)
}

// useDir changes the shell's working directory to dir, where run.log is
// written, so tests do not write into the repository.
func (term *terminal) useDir(dir string) {
	term.dir = dir
	term.typeKeys("cd " + dir + "\n")
}

const stoppedLine = "stopped console, gateway, local-agent, health and planner"

// TestRunStopsOnCtrlC types make run into a terminal with its output on the
// terminal, in a file, and in a pipe (stdout alone, and with stderr), then
// Ctrl-C: every service stops, make returns, and nothing of the run is left
// (with the output in a file, make and the script used to die of the SIGINT
// while the services ran on). Where the output survives, it ends with the
// script's one line; a tee reading stdout and stderr dies of the Ctrl-C
// itself, and the script stops all the same.
func TestRunStopsOnCtrlC(t *testing.T) {
	for _, tc := range []struct {
		name, output string
		stopLine     bool // whether the stop line reaches the terminal or run.log
	}{
		{"terminal", "", true},
		{"file", "> run.log 2>&1", true},
		{"pipe", "| tee run.log", true},
		{"pipe with stderr", "2>&1 | tee run.log", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runDir := t.TempDir()
			term := startTerminal(t, runEnv(t, runDir))
			term.useDir(t.TempDir())
			term.makeRun(tc.output)
			servicePids(t, runDir)

			// make returns (nothing is left of the session), but the shell
			// does not go on to report it: it stops a command line whose
			// command was interrupted.
			term.typeKeys("\x03")
			waitNothingLeft(t, runDir, term.shell.Process.Pid)
			if tc.stopLine && !strings.Contains(term.output()+term.runLog(), stoppedLine) {
				t.Errorf("no %q in the output:\n%s%s", stoppedLine, term.output(), term.runLog())
			}
		})
	}
}

// TestRunStopsWhenTerminalCloses closes the terminal make run runs in (the
// shell gets SIGHUP and passes it on): nothing of the run may be left.
// Before, make, the script and every service ran on.
func TestRunStopsWhenTerminalCloses(t *testing.T) {
	for _, tc := range []struct{ name, output string }{
		{"terminal", ""},
		{"file", "> run.log 2>&1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runDir := t.TempDir()
			term := startTerminal(t, runEnv(t, runDir))
			term.useDir(t.TempDir())
			term.makeRun(tc.output)
			servicePids(t, runDir)

			term.master.Close()
			waitNothingLeft(t, runDir, term.shell.Process.Pid)
		})
	}
}

// TestRunStopsOnSIGTERM sends SIGTERM to the script of a make run on a
// terminal: the services stop in order and make returns 0.
func TestRunStopsOnSIGTERM(t *testing.T) {
	runDir := t.TempDir()
	term := startTerminal(t, runEnv(t, runDir))
	term.useDir(t.TempDir())
	term.makeRun("")
	servicePids(t, runDir)

	if err := syscall.Kill(scriptPid(t, runDir), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "make to return", func() bool { return makeExited.MatchString(term.output()) })
	if m := makeExited.FindStringSubmatch(term.output()); m[1] != "0" {
		t.Errorf("make exited %s after SIGTERM to the script, want 0", m[1])
	}
	waitNothingLeft(t, runDir, term.shell.Process.Pid)
	if !strings.Contains(term.output(), stoppedLine) {
		t.Errorf("no %q in the output", stoppedLine)
	}
}

// TestRunServicesStopWhenScriptKilled kills (SIGKILL) the script that
// started the services, and, apart, the script make started (which runs
// the first as a job on a terminal): the services must stop by themselves,
// and nothing of the run may be left. Before, they ran on.
func TestRunServicesStopWhenScriptKilled(t *testing.T) {
	for _, tc := range []struct {
		name string
		pid  func(t *testing.T, runDir string, sid int) int
	}{
		{"the script that started them", func(t *testing.T, runDir string, _ int) int { return scriptPid(t, runDir) }},
		{"the script make started", func(t *testing.T, runDir string, sid int) int {
			inner := scriptPid(t, runDir)
			for _, pid := range sessionProcesses(sid) {
				b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
				if pid != inner && bytes.Contains(b, []byte("scripts/run.sh")) {
					return pid
				}
			}
			t.Fatalf("no script but %d in the terminal's session", inner)
			return 0
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runDir := t.TempDir()
			term := startTerminal(t, runEnv(t, runDir))
			term.useDir(t.TempDir())
			term.makeRun("")
			servicePids(t, runDir)

			if err := syscall.Kill(tc.pid(t, runDir, term.shell.Process.Pid), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			waitNothingLeft(t, runDir, term.shell.Process.Pid)
		})
	}
}

// TestRunStopsLeftoversOfACrash: the services of a make run whose script
// was killed while they could not act on it (stopped, as a hung process
// is) still hold the state directory and the NATS port. A second make run
// with the same state directory names them and its dead script, stops
// them, and starts.
func TestRunStopsLeftoversOfACrash(t *testing.T) {
	runDir := t.TempDir()
	env := runEnv(t, runDir)
	first := startRunScriptIn(t, runDir, env)
	first.waitBanner()
	pids := servicePids(t, runDir)
	script := scriptPid(t, runDir)
	t.Cleanup(func() { // whatever the test left
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Kill(script, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-first.done

	second := startRunScriptIn(t, runDir, env)
	out := second.waitBanner()
	want := fmt.Sprintf("found leftovers of an earlier make run with its state in %s (its script, pid %d, is gone): stopping console (pid %d), gateway (pid %d), local-agent (pid %d), health (pid %d), planner (pid %d)\n",
		runDir, script, pids["console"], pids["gateway"], pids["local-agent"], pids["health"], pids["planner"])
	if !strings.Contains(out, want) {
		t.Errorf("second run's output:\n%s\nwant the line\n%s", out, want)
	}
	for name, pid := range pids {
		if alive(pid) {
			t.Errorf("the first run's %s (pid %d) still runs", name, pid)
		}
	}
	if got := servicePids(t, runDir); len(got) != 5 {
		t.Errorf("the second run's services: %v", got)
	}
}
