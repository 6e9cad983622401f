package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// The test binary runs main when this variable is set, so the tests start
// the agent as a real process.
const runMainEnv = "PROXMOX_AGENT_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		os.Args = append([]string{name}, strings.Fields(os.Getenv("PROXMOX_AGENT_TEST_ARGS"))...)
		main()
		return
	}
	os.Exit(m.Run())
}

func agentCmd(t *testing.T, args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), runMainEnv+"=1", "PROXMOX_AGENT_TEST_ARGS="+strings.Join(args, " "))
	return cmd
}

func writeConfig(t *testing.T, fake *pvetest.Server, extra string) string {
	t.Helper()
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(fake.Token()), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "proxmox-agent.yaml")
	doc := `entry: pve-home
apiURL: ` + fake.URL + `
tokenFile: ` + token + `
fingerprint: "` + pve.FormatFingerprint(fake.Fingerprint()) + `"
nodes: [pve1, pve2]
templates: {debian-13: 9000}
seedsStorage: proxy-seeds
vlanTag: 4
` + extra
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestCheckConfigNamesTheKey(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	path := writeConfig(t, fake, "clone: fast\n")
	var stderr bytes.Buffer
	cmd := agentCmd(t, "--config", path, "--check-config")
	cmd.Stderr = &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 {
		t.Fatalf("exit = %v, want 2", err)
	}
	if !strings.Contains(stderr.String(), `clone: must be "linked" or "full"`) {
		t.Errorf("stderr = %q", stderr.String())
	}
}

// TestOneProcessServesEveryNode starts the agent as a process against the
// fake and an external NATS server: each node announces itself and answers
// its own check requests; SIGTERM stops it cleanly.
func TestOneProcessServesEveryNode(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{Nodes: []string{"pve1", "pve2"}})
	fake.AddTemplate("pve1", 9000, "debian-13")
	conn := bustest.Start(t)
	path := writeConfig(t, fake, "")
	cmd := agentCmd(t, "--config", path, "--nats-url", conn.ClientURL(), "--data-dir", t.TempDir(), "--replicas", "1", "--log-level", "debug")
	// The agent writes its log straight into a file, which the test reads
	// at any time without sharing a buffer with a copying goroutine.
	stderr := logFile(t)
	cmd.Stderr = stderr.f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var waitErr error
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // an error here means it already exited
		<-exited
	})

	ctx := testwait.Context(t, 60*time.Second)
	// Waits end when the agent exits, whose log then tells why.
	alive, died := context.WithCancel(ctx)
	defer died()
	go func() {
		select {
		case <-exited:
			died()
		case <-alive.Done():
		}
	}()
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		select {
		case <-exited:
			t.Logf("agent exited: %v; stderr:\n%s", waitErr, stderr.String())
		default:
			t.Logf("agent stderr:\n%s", stderr.String())
		}
	})
	for _, n := range []string{"pve1", "pve2"} {
		if hb := agenttest.WaitHeartbeat(alive, t, conn, "pve-home", n); hb.Type != "proxmox" || hb.Target != n {
			t.Fatalf("heartbeat of %s = %+v", n, hb)
		}
	}
	verdicts := agenttest.Check(alive, t, conn, "pve-home", "pve2")
	found := false
	for _, v := range verdicts {
		if v.Check == "node pve2" {
			found = v.OK
		}
	}
	if !found {
		t.Errorf("check of pve2 = %+v, want node pve2 online", verdicts)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		if waitErr != nil {
			t.Errorf("agent exit after SIGTERM: %v\n%s", waitErr, stderr.String())
		}
	case <-ctx.Done():
		t.Fatal("agent did not stop on SIGTERM")
	}
	logs := stderr.String()
	if !strings.Contains(logs, `"route":"/cluster/resources"`) {
		t.Errorf("no debug line per API call in the log:\n%s", logs)
	}
	_, secret, _ := strings.Cut(fake.Token(), "=")
	if strings.Contains(logs, secret) {
		t.Error("the agent logged its API token")
	}
}

// processLog is a file a child process writes its stderr into.
type processLog struct{ f *os.File }

func logFile(t *testing.T) processLog {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "stderr.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return processLog{f: f}
}

// String is what the process has written so far.
func (l processLog) String() string {
	b, err := os.ReadFile(l.f.Name())
	if err != nil {
		return "(log unreadable: " + err.Error() + ")"
	}
	return string(b)
}
