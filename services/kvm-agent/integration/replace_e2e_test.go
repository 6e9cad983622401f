//go:build e2e

package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestDestroyedDomainIsReplaced is the fleet healing a dead VM on a real
// libvirtd: a planner, the health service and the kvm agent run a pool of
// one booted guest; `virsh destroy` of its domain behind the agent's back →
// the agent's recheck records failed (class terminated), the planner
// retires the proxy and requests a replacement, the agent deletes the dead
// domain and boots the replacement, which health finds ready.
func TestDestroyedDomainIsReplaced(t *testing.T) {
	g := needGuestTier(t)
	gateway := g.gateway
	entry := randomEntry(t)
	// The default recheck interval: the delay logged below is the one an
	// operator gets.
	conn, _ := g.agentOn(t, entry)
	ctx := t.Context()
	startHealth(t, conn.ClientURL(), gateway)
	startPlanner(t, conn.ClientURL())

	const poolName = "kvmheal"
	applyPool(t, conn, events.PoolSpec{Name: poolName, Provider: entry, Size: 1, Image: "guest", Profile: "tiny", Port: 3128,
		UserData: "#!/bin/sh\nexec /bin/fwdproxy -listen :3128\n"})
	store := bus.NewEventStore(conn, "e2e", nil)
	start := time.Now()
	var first string
	eventually(t, "one ready proxy in the pool", 5*time.Minute, func() bool {
		ready := proxiesIn(t, store, poolName, events.ProxyReady)
		if len(ready) == 1 {
			first = ready[0]
		}
		return first != ""
	})
	name := events.InstanceName(first)
	fmt.Printf("kvm e2e: pool apply to a ready proxy %s\n", time.Since(start).Round(time.Millisecond))

	if out, err := virsh(t, "destroy", name); err != nil {
		t.Fatalf("virsh destroy %s: %v: %s", name, err, out)
	}
	killed := time.Now()
	var failed *bus.Event
	eventually(t, "the agent's failed event", 2*agent.DefaultRecheckInterval+30*time.Second, func() bool {
		failed, _ = store.LastOf(ctx, events.AggregateProxy, first, events.ProxyFailed)
		return failed != nil
	})
	var f events.ProxyFailedData
	if err := failed.DecodeData(&f); err != nil || f.Class != events.ClassTerminated {
		t.Fatalf("failed = %+v, %v; want class %s", f, err, events.ClassTerminated)
	}
	fmt.Printf("kvm e2e: destroyed domain to failed (%s) %s (recheck interval %s)\n", f.Reason, failed.Time.Sub(killed).Round(time.Millisecond), agent.DefaultRecheckInterval)
	eventually(t, "the planner to retire the dead proxy and the agent to delete it", time.Minute, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, first)
		return err == nil && last != nil && last.Kind == events.ProxyDeleted
	})
	if r, _ := store.LastOf(ctx, events.AggregateProxy, first, events.ProxyRetiring); r == nil {
		t.Fatal("the dead proxy was deleted without a retiring decision")
	}
	if st := domState(t, name); st != "absent" {
		t.Errorf("dead domain %s is %q after delete, want absent", name, st)
	}
	var second string
	eventually(t, "a ready replacement", 5*time.Minute, func() bool {
		for _, id := range proxiesIn(t, store, poolName, events.ProxyReady) {
			if id != first {
				second = id
			}
		}
		return second != ""
	})
	fmt.Printf("kvm e2e: destroyed domain to a ready replacement %s\n", time.Since(killed).Round(time.Millisecond))

	deletePool(t, conn, poolName)
	eventually(t, "the replacement deleted with its pool", 2*time.Minute, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, second)
		return err == nil && last != nil && last.Kind == events.ProxyDeleted
	})
}

// proxiesIn replays the log and returns the proxies of pool whose last
// event is kind.
func proxiesIn(t *testing.T, store *bus.EventStore, pool, kind string) []string {
	t.Helper()
	member := map[string]bool{}
	last := map[string]string{}
	err := store.Replay(context.Background(), 0, func(e bus.Event) error {
		if e.Aggregate != events.AggregateProxy {
			return nil
		}
		if e.Kind == events.ProxyRequested {
			var r events.ProxyRequestedData
			if e.DecodeData(&r) == nil && r.Pool == pool {
				member[e.ID] = true
			}
		}
		last[e.ID] = e.Kind
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for id := range member {
		if last[id] == kind {
			out = append(out, id)
		}
	}
	return out
}

// untilServed calls fn, one request of the planner's API, again while no
// planner answers yet, and fails the test on any other error.
func untilServed(t *testing.T, what string, fn func(context.Context) error) {
	t.Helper()
	var err error
	for range 100 {
		if err = fn(context.Background()); !errors.Is(err, api.ErrNoReply) {
			break
		}
		time.Sleep(100 * time.Millisecond) // the planner may still be starting
	}
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// applyPool applies spec to the planner on conn.
func applyPool(t *testing.T, conn *bus.Conn, spec events.PoolSpec) {
	t.Helper()
	planner := api.NewClient(conn.NC, api.WithTimeout(5*time.Second))
	untilServed(t, "pool.apply "+spec.Name, func(ctx context.Context) error {
		_, err := planner.PoolApply(ctx, spec)
		return err
	})
}

// deletePool deletes pool name through the planner on conn.
func deletePool(t *testing.T, conn *bus.Conn, name string) {
	t.Helper()
	planner := api.NewClient(conn.NC, api.WithTimeout(5*time.Second))
	untilServed(t, "pool.delete "+name, func(ctx context.Context) error {
		_, err := planner.PoolDelete(ctx, name)
		return err
	})
}

// startPlanner builds and runs the planner against the test's NATS server.
func startPlanner(t *testing.T, natsURL string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "planner")
	if out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", bin, "proxyfleet/services/planner/cmd/planner").CombinedOutput(); err != nil {
		t.Fatalf("build planner: %v\n%s", err, out)
	}
	logf, err := os.Create(filepath.Join(dir, "planner.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--nats-url", natsURL, "--data-dir", filepath.Join(dir, "data"), "--reconcile-interval", "500ms")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("planner log:\n%s", b)
		}
		logf.Close()
	})
}
