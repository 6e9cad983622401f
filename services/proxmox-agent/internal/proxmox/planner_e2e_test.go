package proxmox_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// buildServices builds (with the workspace's go, in one invocation) the
// binaries of the named proxyfleet services into a temporary directory.
func buildServices(t *testing.T, svcs ...string) string {
	t.Helper()
	goBin := testgate.NeedBinary(t, "go", "the end-to-end test builds the planner and health binaries")
	dir := t.TempDir()
	args := []string{"build", "-tags", "grpcnotrace", "-o", dir + string(filepath.Separator)}
	for _, s := range svcs {
		args = append(args, "proxyfleet/services/"+s+"/cmd/"+s)
	}
	if out, err := exec.Command(goBin, args...).CombinedOutput(); err != nil {
		t.Fatalf("build %v: %v\n%s", svcs, err, out)
	}
	return dir
}

// startService starts the binary of svc from binDir connected to conn, and
// stops it at the end of the test.
func startService(t *testing.T, binDir string, conn *bus.Conn, svc string, args ...string) *testwait.Buffer {
	t.Helper()
	bin := filepath.Join(binDir, svc)
	args = append([]string{"--nats-url", conn.ClientURL(), "--data-dir", t.TempDir(), "--replicas", "1", "--log-level", "debug"}, args...)
	cmd := exec.Command(bin, args...)
	logs := &testwait.Buffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		testwait.Stop(cmd, os.Interrupt, 10*time.Second)
		if t.Failed() {
			t.Logf("%s output:\n%s", svc, logs.String())
		}
	})
	return logs
}

// accepted calls fn, one request of the planner's API, until it
// succeeds, and fails the test on a refusal. While no planner answers yet,
// and while the refusal's message contains retryWhile (when not ""), it
// calls fn again until ctx ends.
func accepted(t *testing.T, ctx context.Context, what, retryWhile string, fn func(context.Context) error) {
	t.Helper()
	for {
		err := fn(ctx)
		aerr, refused := errors.AsType[*api.APIError](err)
		switch {
		case err == nil:
			return
		case ctx.Err() != nil:
			t.Fatalf("%s: %v", what, err)
		case errors.Is(err, api.ErrNoReply):
			// The planner is not serving yet.
		case refused && retryWhile != "" && strings.Contains(aerr.Message, retryWhile):
		default:
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestPoolThroughPlannerAndHealth: a pool of 3 applied to the planner
// reaches running on the fake with the guest agent's addresses; deleting
// the pool leaves no VM, no seed and no VMID reservation.
func TestPoolThroughPlannerAndHealth(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the planner and health services")
	}
	e := newEnv(t, pvetest.Options{})
	ctx := ctxT(t, 4*time.Minute)
	bins := buildServices(t, "planner", "health")
	startService(t, bins, e.conn, "planner", "--reconcile-interval", "200ms")
	startService(t, bins, e.conn, "health", "--echo-addr", "127.0.0.1:0", "--probe-interval", "1s",
		"--probe-timeout", "500ms", "--check-interval", "1s", "--unhealthy-after", "1000")
	e.runAgent(e.driver())

	// The planner takes the pool whether or not it has seen the agent's
	// heartbeat yet, and places it once it has.
	planner := api.NewClient(e.conn.NC)
	accepted(t, ctx, "pool.apply web", "", func(ctx context.Context) error {
		_, err := planner.PoolApply(ctx, events.PoolSpec{Name: "web", Provider: entry, Size: 3, Image: "debian-13", Profile: "small"})
		return err
	})

	store := bus.NewEventStore(e.conn, "test", nil)
	running := map[string]events.ProxyRunningData{}
	for len(running) < 3 {
		for _, v := range e.fake.VMs() {
			proxy := markerProxy(v.Conf["description"])
			if proxy == "" || !v.Running {
				continue
			}
			evs, err := store.Load(ctx, events.AggregateProxy, proxy)
			if err != nil {
				t.Fatal(err)
			}
			for _, ev := range evs {
				if ev.Kind == events.ProxyRunning {
					var run events.ProxyRunningData
					if err := ev.DecodeData(&run); err != nil {
						t.Fatal(err)
					}
					if want := pvetest.GuestAddress(v.VMID) + ":3128"; run.Address != want || run.ProviderID != strconv.Itoa(v.VMID) {
						t.Errorf("proxy %s running at %q on %q, want %q on %d", proxy, run.Address, run.ProviderID, want, v.VMID)
					}
					running[proxy] = run
				}
			}
		}
		if len(running) >= 3 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of 3 proxies running; VMs: %+v", len(running), e.fake.VMs())
		case <-time.After(50 * time.Millisecond):
		}
	}
	if n := len(e.fake.VMs()); n != 3 {
		t.Errorf("%d VMs for a pool of 3", n)
	}

	accepted(t, ctx, "pool.delete web", "", func(ctx context.Context) error {
		_, err := planner.PoolDelete(ctx, "web")
		return err
	})
	for {
		vms, seeds, keys := e.fake.VMs(), e.fake.Volumes(node, "proxy-seeds"), e.reservations()
		if len(vms) == 0 && len(seeds) == 0 && len(keys) == 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("after the pool's deletion: VMs %+v, seeds %v, VMID reservations %v", vms, seeds, keys)
		case <-time.After(50 * time.Millisecond):
		}
	}
	for proxy := range running {
		last, err := store.Last(ctx, events.AggregateProxy, proxy)
		if err != nil || last == nil || last.Kind != events.ProxyDeleted {
			t.Errorf("proxy %s: last event %v (%v), want deleted", proxy, last, err)
		}
	}
}

func markerProxy(desc string) string {
	for _, l := range strings.Split(desc, "\n") {
		if v, ok := strings.CutPrefix(l, "proxyfleet.proxy: "); ok {
			return v
		}
	}
	return ""
}
