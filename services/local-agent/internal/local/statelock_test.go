package local

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/bus/bustest"
)

func TestLockStateDirRefusesASecondHolder(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "proxies")
	first, err := LockStateDir(dir)
	if err != nil {
		t.Fatalf("first lock: %v", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, LockFile))
	if want := strconv.Itoa(os.Getpid()) + "\n"; err != nil || string(b) != want {
		t.Fatalf("lock file holds %q (%v), want %q", b, err, want)
	}
	// flock conflicts between open files, also within one process.
	_, err = LockStateDir(dir)
	if !errors.Is(err, ErrStateDirInUse) {
		t.Fatalf("second lock: %v, want ErrStateDirInUse", err)
	}
	for _, want := range []string{"pid " + strconv.Itoa(os.Getpid()), dir + " is held by", "--state-dir"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	again, err := LockStateDir(dir)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	_ = again.Release()
}

// TestSecondAgentProcessRefusesTheStateDir runs the agent binary: a second
// agent on the same data directory exits at once naming the first one's
// pid and the directory; after the first is killed with SIGKILL (no
// clean-up), a new agent starts on the directory.
func TestSecondAgentProcessRefusesTheStateDir(t *testing.T) {
	conn := bustest.Start(t)
	dataDir := t.TempDir()
	stateDir := filepath.Join(dataDir, "proxies")
	lockPath := filepath.Join(stateDir, LockFile)
	start := func(logName string) (*exec.Cmd, string) {
		logPath := filepath.Join(dataDir, logName)
		logf, err := os.Create(logPath)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { logf.Close() })
		cmd := exec.Command(agentBin, "--nats-url", conn.ClientURL(), "--data-dir", dataDir,
			"--ports", "0", "--capacity", "2", "--target", testTarget)
		cmd.Stdout, cmd.Stderr = logf, logf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			}
		})
		return cmd, logPath
	}
	// serving waits until cmd holds the lock and has started its runtime.
	serving := func(cmd *exec.Cmd, logPath string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			b, _ := os.ReadFile(lockPath)
			logged, _ := os.ReadFile(logPath)
			if string(b) == strconv.Itoa(cmd.Process.Pid)+"\n" && strings.Contains(string(logged), `"msg":"local backend"`) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("agent pid %d did not take %s and start; lock file %q, log:\n%s", cmd.Process.Pid, lockPath, b, logged)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	first, firstLog := start("first.log")
	serving(first, firstLog)

	second, secondLog := start("second.log")
	err := second.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("second agent: %v, want exit status 1", err)
	}
	out, _ := os.ReadFile(secondLog)
	for _, want := range []string{"local-agent: state directory in use: " + stateDir + " is held by local-agent pid " + strconv.Itoa(first.Process.Pid)} {
		if !strings.Contains(string(out), want) {
			t.Errorf("second agent's output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), `"msg"`) {
		t.Errorf("the second agent logged, so it started something:\n%s", out)
	}

	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()
	third, thirdLog := start("third.log")
	serving(third, thirdLog)
	if err := third.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := third.Wait(); err != nil {
		logged, _ := os.ReadFile(thirdLog)
		t.Fatalf("third agent after SIGTERM: %v\n%s", err, logged)
	}
}
