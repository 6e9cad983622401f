package e2e_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testnet"
)

// idleRSSLimitMB is the most resident memory a service may use at idle.
const idleRSSLimitMB = 25

// idleRounds is how many rounds of its periodic work a service does before
// its memory is read: the fourth heartbeat of an agent comes 15 s after it
// started (one every 5 s) and after its first recheck (10 s).
const idleRounds = 4

// The entry and target of every agent measured, and of the agent health
// checks.
const idleEntry, idleTarget = "bench", "idle"

// BenchmarkIdleRSS measures the resident memory (VmRSS) of every service
// binary at idle: built as `make build` builds it, started against a
// JetStream server of its own in the test, its backend (if any) a dead
// loopback address, and read once the service has done [idleRounds] rounds
// of its periodic work, observed in NATS. It reports rss-MB (with the
// anonymous and file-backed parts; MB here is 2^20 bytes) and fails a
// service above [idleRSSLimitMB]. The baseline is idlebase, a program
// doing an agent's idle NATS work with nothing else linked, measured the
// same way in the same run (make bench prints each service's ratio to it).
func BenchmarkIdleRSS(b *testing.B) {
	bin := idleBinaries(b)
	for _, s := range idleServices() {
		b.Run(s.name, func(b *testing.B) {
			var m idleMemory
			for b.Loop() {
				m = measureIdle(b, bin, s)
			}
			// Neither the time to settle nor the test's own allocations
			// are results.
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(0, "B/op")
			b.ReportMetric(0, "allocs/op")
			b.ReportMetric(m.mb(m.rss), "rss-MB")
			b.ReportMetric(m.mb(m.anon), "anon-MB")
			b.ReportMetric(m.mb(m.file), "file-MB")
			if s.name != "baseline" && m.mb(m.rss) > idleRSSLimitMB {
				b.Errorf("%s idles at %.1f MB resident (%d kB), over the limit of %d MB", s.name, m.mb(m.rss), m.rss, idleRSSLimitMB)
			}
		})
	}
}

// idleService is one binary to measure: its arguments (besides the NATS
// URL and data directory) and the rounds of periodic work it does at idle.
type idleService struct {
	name string
	args func(b *testing.B, dir string) []string
	// rounds returns a channel that receives once per round of the
	// service's periodic work, set up before the service starts.
	rounds func(b *testing.B, conn *bus.Conn) <-chan struct{}
}

func idleServices() []idleService {
	agentArgs := func(name string, args func(b *testing.B, dir string) []string) idleService {
		return idleService{name: name, args: args, rounds: heartbeats}
	}
	return []idleService{
		{name: "baseline", rounds: heartbeats, args: func(*testing.B, string) []string {
			return []string{"--bucket", bus.BucketAgents, "--key", agent.HeartbeatKey(idleEntry, idleTarget)}
		}},
		// The leader lease is renewed every third of its TTL.
		{name: "planner", rounds: kvPuts(bus.BucketPlanner, ">"), args: func(*testing.B, string) []string { return nil }},
		// Health checks every live agent each --check-interval and stores
		// the verdicts in fleet-targets; the test runs one agent for it.
		{name: "health", rounds: checkRounds, args: func(*testing.B, string) []string {
			return []string{"--echo-addr", "127.0.0.1:0", "--check-interval", "5s"}
		}},
		agentArgs("local-agent", func(_ *testing.B, dir string) []string {
			return []string{"--entry", idleEntry, "--target", idleTarget, "--ports", "0", "--capacity", "4", "--state-dir", filepath.Join(dir, "proxies")}
		}),
		agentArgs("kvm-agent", func(b *testing.B, dir string) []string {
			return configArgs(b, dir, "entry: "+idleEntry+"\ntarget: "+idleTarget+"\npool: default\nnetwork: default\n"+
				"libvirt: {socket: "+filepath.Join(dir, "no-libvirtd.sock")+"}\n"+
				"images: {debian-12: {url: \"https://images.example/debian-12.qcow2\"}}\n"+
				"profiles: {small: {vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n")
		}),
		agentArgs("proxmox-agent", func(b *testing.B, dir string) []string {
			token := writeIdleFile(b, dir, "token", "root@pam!fleet=00000000-0000-0000-0000-000000000000\n")
			return configArgs(b, dir, "entry: "+idleEntry+"\napiURL: https://"+testnet.Refusing(b).String()+"\ntokenFile: "+token+"\n"+
				"fingerprint: \""+strings.Repeat("AB:", 31)+"AB\"\nnodes: ["+idleTarget+"]\ntemplates: {debian-13: 9000}\n"+
				"seedsStorage: proxy-seeds\nvlanTag: 4\n")
		}),
		// One kubernetes entry whose API server refuses connections.
		agentArgs("cloud-agent", func(b *testing.B, dir string) []string {
			kubeconfig := writeIdleFile(b, dir, "kubeconfig", "apiVersion: v1\nkind: Config\n"+
				"clusters: [{name: dead, cluster: {server: \"https://"+testnet.Refusing(b).String()+"\"}}]\n"+
				"users: [{name: u, user: {token: tok}}]\n"+
				"contexts: [{name: dead, context: {cluster: dead, user: u}}]\ncurrent-context: dead\n")
			return configArgs(b, dir, "entries:\n  - name: "+idleEntry+"\n    type: kubernetes\n    targets: ["+idleTarget+"]\n"+
				"    kubernetes: {kubeconfig: "+kubeconfig+"}\n")
		}),
	}
}

func writeIdleFile(b *testing.B, dir, name, body string) string {
	b.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		b.Fatal(err)
	}
	return p
}

func configArgs(b *testing.B, dir, config string) []string {
	return []string{"--config", writeIdleFile(b, dir, "config.yaml", config)}
}

// heartbeats signals each heartbeat of the agent idleEntry/idleTarget.
func heartbeats(b *testing.B, conn *bus.Conn) <-chan struct{} {
	return kvPuts(bus.BucketAgents, agent.HeartbeatKey(idleEntry, idleTarget))(b, conn)
}

// checkRounds runs an agent for health to check and signals each round
// of health's checks, as the verdicts it stores in fleet-targets.
func checkRounds(b *testing.B, conn *bus.Conn) <-chan struct{} {
	rt, err := agent.New(bustest.Dial(b, conn), idleDriver{},
		agent.Config{Info: agent.Info{Entry: idleEntry, Target: idleTarget, Type: "bench"}}, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	agenttest.Serve(b, rt.Run)
	return kvPuts(bus.BucketTargets, agent.HeartbeatKey(idleEntry, idleTarget))(b, conn)
}

// kvPuts signals every put to key (a wildcard allowed) of bucket.
func kvPuts(bucket, key string) func(b *testing.B, conn *bus.Conn) <-chan struct{} {
	return func(b *testing.B, conn *bus.Conn) <-chan struct{} {
		b.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		b.Cleanup(cancel)
		kv, err := conn.JS.KeyValue(ctx, bucket)
		if err != nil {
			b.Fatal(err)
		}
		w, err := kv.Watch(ctx, key, jetstream.UpdatesOnly())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = w.Stop() })
		out := make(chan struct{}, 64)
		go func() {
			for e := range w.Updates() {
				if e == nil || e.Operation() != jetstream.KeyValuePut {
					continue
				}
				select {
				case out <- struct{}{}:
				case <-ctx.Done():
					return
				}
			}
		}()
		return out
	}
}

// idleDriver is the backend of the agent health checks: nothing to list,
// one passing check.
type idleDriver struct{}

var _ agent.Driver = idleDriver{}

func (idleDriver) Create(context.Context, agent.Spec) (agent.Instance, error) {
	return agent.Instance{}, agent.ErrPermanent
}

func (idleDriver) Get(context.Context, agent.Ref) (agent.Instance, error) {
	return agent.Instance{}, agent.ErrNotFound
}

func (idleDriver) Delete(context.Context, agent.Ref) error        { return agent.ErrNotFound }
func (idleDriver) List(context.Context) ([]agent.Instance, error) { return nil, nil }
func (idleDriver) Check(context.Context) []agent.Verdict {
	return []agent.Verdict{{Check: "bench", OK: true}}
}

var (
	idleBuildOnce sync.Once
	idleBinDir    string
	idleBuildErr  error
)

// idleBinaries builds every service with `make build-<service>` (so with
// the build tags and flags make build uses) and the baseline with go build,
// once for the test binary, and returns their directory.
func idleBinaries(b *testing.B) string {
	b.Helper()
	idleBuildOnce.Do(func() {
		// Under binDir, which TestMain removes.
		idleBinDir = filepath.Join(binDir, "idle")
		targets := []string{"--no-print-directory", "-C", "..", "BIN=" + idleBinDir}
		for _, s := range idleServices() {
			if s.name != "baseline" {
				targets = append(targets, "build-"+s.name)
			}
		}
		if out, err := exec.Command("make", targets...).CombinedOutput(); err != nil {
			idleBuildErr = fmt.Errorf("make %s: %v\n%s", strings.Join(targets, " "), err, out)
			return
		}
		if out, err := exec.Command("go", "build", "-o", filepath.Join(idleBinDir, "baseline"), "./internal/idlebase").CombinedOutput(); err != nil {
			idleBuildErr = fmt.Errorf("build the baseline: %v\n%s", err, out)
		}
	})
	if idleBuildErr != nil {
		b.Fatal(idleBuildErr)
	}
	return idleBinDir
}

// idleMemory is one reading of /proc/<pid>/status, in kB.
type idleMemory struct{ rss, anon, file int }

func (idleMemory) mb(kb int) float64 { return float64(kb) / 1024 }

// measureIdle starts s against a server of its own, waits for idleRounds
// rounds of its periodic work, reads its memory and stops it.
func measureIdle(b *testing.B, bin string, s idleService) idleMemory {
	b.Helper()
	conn := bustest.Start(b)
	rounds := s.rounds(b, conn)
	dir := b.TempDir()
	args := append([]string{"--nats-url", conn.ClientURL()}, s.args(b, dir)...)
	if s.name != "baseline" {
		args = append(args, "--data-dir", filepath.Join(dir, "data"))
	}
	var log bytes.Buffer
	cmd := exec.Command(filepath.Join(bin, s.name), args...)
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}()
	deadline := time.After(90 * time.Second)
	for n := 0; n < idleRounds; n++ {
		select {
		case <-rounds:
		case err := <-exited:
			exited <- err
			b.Fatalf("%s exited (%v) after %d of %d rounds:\n%s", s.name, err, n, idleRounds, &log)
		case <-deadline:
			b.Fatalf("%s did %d of %d rounds of its idle work within 90s:\n%s", s.name, n, idleRounds, &log)
		}
	}
	return readMemory(b, cmd.Process.Pid)
}

func readMemory(b *testing.B, pid int) idleMemory {
	b.Helper()
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	var m idleMemory
	for _, l := range strings.Split(string(st), "\n") {
		name, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		if err != nil {
			continue
		}
		switch name {
		case "VmRSS":
			m.rss = kb
		case "RssAnon":
			m.anon = kb
		case "RssFile":
			m.file = kb
		}
	}
	if m.rss == 0 {
		b.Fatalf("no VmRSS in /proc/%d/status:\n%s", pid, st)
	}
	return m
}
