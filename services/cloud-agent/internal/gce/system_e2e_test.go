//go:build e2e

package gce

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// system runs planner, health and cloud-agent as processes on one NATS
// server, with the cloud-agent's gce entry pointed at the fake.
type system struct {
	t     *testing.T
	conn  *bus.Conn
	dir   string
	procs map[string]*exec.Cmd
}

func (s *system) build(svc string) string {
	s.t.Helper()
	out := filepath.Join(s.dir, "bin", svc)
	cmd := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", out, "proxyfleet/services/"+svc+"/cmd/"+svc)
	if b, err := cmd.CombinedOutput(); err != nil {
		s.t.Fatalf("build %s: %v\n%s", svc, err, b)
	}
	return out
}

func (s *system) start(svc string, args ...string) {
	s.t.Helper()
	bin := s.build(svc)
	logf, err := os.Create(filepath.Join(s.dir, svc+".log"))
	if err != nil {
		s.t.Fatal(err)
	}
	common := []string{"--nats-url", s.conn.ClientURL(), "--data-dir", filepath.Join(s.dir, svc), "--log-level", "debug"}
	cmd := exec.Command(bin, append(common, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	s.procs[svc] = cmd
	s.t.Cleanup(func() {
		testwait.Stop(cmd, syscall.SIGTERM, 15*time.Second)
	})
}

func (s *system) log(svc string) string {
	b, _ := os.ReadFile(filepath.Join(s.dir, svc+".log"))
	return string(b)
}

// untilServed calls fn, one request of the planner's API, again while no
// planner answers yet, and fails the test on any other error.
func (s *system) untilServed(what string, fn func(context.Context) error) {
	s.t.Helper()
	var err error
	for range 100 { // the planner may still be starting
		if err = fn(context.Background()); !errors.Is(err, api.ErrNoReply) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		s.t.Fatalf("%s: %v", what, err)
	}
}

type proxyView struct {
	ID      string `json:"id"`
	Pool    string `json:"pool"`
	State   string `json:"state"`
	Address string `json:"address"`
}

func (s *system) proxies(pool string) []proxyView {
	ctx := context.Background()
	kv, err := s.conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		s.t.Fatal(err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	var out []proxyView
	for k := range keys.Keys() {
		e, err := kv.Get(ctx, k)
		if err != nil {
			continue
		}
		var v proxyView
		if json.Unmarshal(e.Value(), &v) == nil && v.Pool == pool {
			out = append(out, v)
		}
	}
	return out
}

func (s *system) waitFor(what string, within time.Duration, cond func() bool) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if testwait.For(ctx, cond) == nil {
		return
	}
	s.t.Fatalf("timed out waiting for %s\n--- cloud-agent log tail:\n%s\n--- planner log tail:\n%s", what, tail(s.log("cloud-agent")), tail(s.log("planner")))
}

func tail(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}

// TestSystemPoolOnGCE: a pool of 2 on a gce entry, through the planner,
// health and the cloud-agent binary, reaches running with addresses; its
// deletion leaves no instance; no service logs a secret.
func TestSystemPoolOnGCE(t *testing.T) {
	f := newFakeCompute(t, "zone-a", "zone-b")
	keyFile, keyID, _ := serviceAccountFile(t, f)
	s := &system{t: t, conn: bustest.Start(t), dir: t.TempDir(), procs: map[string]*exec.Cmd{}}
	cfg := fmt.Sprintf(`entries:
  - name: gce-eu
    type: gce
    targets: [zone-a, zone-b]
    gce:
      project: proj-1
      credentialsFile: %s
      endpoint: %s
      images: {debian-12: projects/debian-cloud/global/images/family/debian-12}
      defaultImage: debian-12
      profiles: {small: e2-small}
      defaultProfile: small
      externalIP: true
`, keyFile, f.base())
	cfgPath := filepath.Join(s.dir, "cloud-agent.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	// Health binds its echo endpoint where the kernel puts it.
	echo := "127.0.0.1:0"

	s.start("cloud-agent", "--config", cfgPath)
	s.start("planner", "--reconcile-interval", "200ms")
	// The fake's addresses do not answer probes: keep health from declaring
	// them unhealthy (and the planner from replacing them) during the test.
	s.start("health", "--echo-addr", echo, "--probe-interval", "1h", "--unhealthy-after", "1000", "--check-interval", "1s")
	kv, err := s.conn.JS.KeyValue(context.Background(), bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	s.waitFor("both zones' heartbeats", 60*time.Second, func() bool {
		_, errA := kv.Get(context.Background(), "gce-eu.zone-a")
		_, errB := kv.Get(context.Background(), "gce-eu.zone-b")
		return errA == nil && errB == nil
	})

	const password = "pw-system-canary-5c4b"
	planner := api.NewClient(s.conn.NC, api.WithTimeout(5*time.Second))
	s.untilServed("pool.apply gpool", func(ctx context.Context) error {
		_, err := planner.PoolApply(ctx, events.PoolSpec{Name: "gpool", Provider: "gce-eu", Size: 2, Auth: &events.ProxyAuth{Username: "crawler", Password: password}})
		return err
	})
	s.waitFor("2 running proxies with addresses", 90*time.Second, func() bool {
		ps := s.proxies("gpool")
		if len(ps) != 2 {
			return false
		}
		for _, p := range ps {
			if p.State != "running" || !strings.HasPrefix(p.Address, "203.0.113.") {
				return false
			}
		}
		return true
	})
	if n := f.count(); n != 2 {
		t.Fatalf("%d instances, want 2", n)
	}
	// No user-data in the pool: every instance got the default cloud-config.
	f.mu.Lock()
	for _, zone := range f.instances {
		for _, inst := range zone {
			if ud := *inst.Metadata.Items[0].Value; !strings.HasPrefix(ud, "#cloud-config") {
				t.Errorf("instance %s user-data starts %q, want the default cloud-config", inst.Name, ud[:min(20, len(ud))])
			}
		}
	}
	f.mu.Unlock()

	s.untilServed("pool.delete gpool", func(ctx context.Context) error {
		_, err := planner.PoolDelete(ctx, "gpool")
		return err
	})
	s.waitFor("the pool's instances to be deleted", 90*time.Second, func() bool {
		return f.count() == 0 && len(s.proxies("gpool")) == 0
	})

	for _, svc := range []string{"cloud-agent", "planner", "health"} {
		out := s.log(svc)
		for name, secret := range map[string]string{"access token": fakeAccessToken, "key id": keyID, "proxy password": password, "cloud-config": "#cloud-config"} {
			if strings.Contains(out, secret) {
				t.Errorf("%s logs the %s", svc, name)
			}
		}
	}
	if !strings.Contains(s.log("cloud-agent"), "gce api call") {
		t.Error("the cloud-agent logged no API calls at debug level")
	}
}
