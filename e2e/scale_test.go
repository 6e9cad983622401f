package e2e_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestTenThousandProxyPoolConverges: a pool of 10,000 proxies on an instant
// backend (every instance runs the moment it is created, all behind one
// built-in forward proxy process on loopback) becomes ready through the
// real planner and health binaries, with exactly one request per proxy and
// not a single unhealthy verdict on the way.
func TestTenThousandProxyPoolConverges(t *testing.T) {
	if testing.Short() {
		t.Skip("converges a 10,000-proxy pool")
	}
	const size = 10_000
	f := newFleet(t)
	f.dumpLogsOnFailure()
	f.startPlanner()
	// Default probing: the fleet must be probed at its own pace.
	f.start("health", "--echo-addr", "127.0.0.1:0")
	drv := agenttest.NewInstant(forwardProxy(t, f.echoEndpoint()))
	rt, err := agent.New(f.conn, drv, agent.Config{Info: agent.Info{Entry: "instant", Target: "t1", Type: "instant"}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Serve(t, rt.Run)
	f.waitAgent("instant", "t1")
	f.waitLeader()

	start := time.Now()
	f.apply(events.PoolSpec{Name: "big", Provider: "instant", Size: size})
	var ready int
	var states map[string]int
	defer func() {
		if t.Failed() {
			t.Logf("pool big: %v; backend instances: %d; create commands stored: %d", states, drv.Len(), f.cmdCount("fleet.cmd.instant.t1.create"))
			if info, err := f.conn.JS.Consumer(context.Background(), bus.CommandsStream, bus.AgentConsumerName("instant", "t1")); err == nil {
				ci := info.CachedInfo()
				t.Logf("agent consumer: %d pending, %d awaiting ack, %d redelivered, delivered up to %d", ci.NumPending, ci.NumAckPending, ci.NumRedelivered, ci.Delivered.Stream)
			}
		}
	}()
	// The pool converges at the machine's pace: minutes on a quiet
	// machine, many more on a shared, loaded one (make bench
	// measures the rate). The test fails when the ready count stops
	// growing for two minutes, or after 25 minutes in all, inside the
	// 35 minutes make test gives a package.
	waitProgress(t, 25*time.Minute, 2*time.Minute, fmt.Sprintf("%d ready proxies in pool big", size), func() (int, bool) {
		pv, err := retry(t, "pool.get big", func(ctx context.Context) (api.PoolView, error) { return f.api.PoolGet(ctx, "big") })
		if err != nil {
			return ready, false
		}
		states = pv.States
		ready = pv.States[events.ProxyReady]
		return ready, ready == size
	})
	t.Logf("%d proxies ready %s after the apply", size, time.Since(start).Round(time.Millisecond))
	if n := drv.Len(); n != size {
		t.Errorf("the backend holds %d instances, want %d", n, size)
	}
	// One proxy requested per slot: no replacement, no duplicate. A
	// create the agent's backed-up queue did not start within
	// --create-timeout (3 min) is re-issued for the same proxy (its
	// requested event again, next attempt): seen on a loaded machine,
	// where the agent's queue held thousands of creates; it is counted,
	// not failed.
	proxies, requests := f.subjectCount("fleet.evt.proxy.*." + events.ProxyRequested)
	if proxies != size {
		t.Errorf("%d proxies requested, want exactly %d", proxies, size)
	}
	t.Logf("%d creates re-issued after the create timeout", requests-uint64(proxies))
	if n := f.eventCount("fleet.evt.proxy.*." + events.ProxyUnhealthy); n != 0 {
		t.Errorf("%d unhealthy verdicts while converging, want none", n)
	}
}

// waitProgress waits until cond reports done. It fails when the count cond
// reports has not grown for stall, or after within in all.
func waitProgress(t *testing.T, within, stall time.Duration, what string, cond func() (count int, done bool)) {
	t.Helper()
	start := time.Now()
	best, grew := -1, start
	for {
		n, done := cond()
		if done {
			return
		}
		now := time.Now()
		if n > best {
			best, grew = n, now
		}
		switch {
		case now.Sub(grew) > stall:
			t.Fatalf("waiting for %s: stuck at %d for %s (%s in all)", what, best, stall, now.Sub(start).Round(time.Second))
		case now.Sub(start) > within:
			t.Fatalf("timed out after %s waiting for %s: at %d, still growing", within, what, best)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// cmdCount counts FLEET_CMDS messages on subjects matching filter.
func (f *fleet) cmdCount(filter string) uint64 {
	f.t.Helper()
	s, err := f.conn.JS.Stream(context.Background(), bus.CommandsStream)
	if err != nil {
		return 0
	}
	info, err := s.Info(context.Background(), jetstream.WithSubjectFilter(filter))
	if err != nil {
		return 0
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n
}

// forwardProxy runs the product's built-in forward proxy (local-agent
// proxy) on a loopback port the kernel chose, handed over as a listening
// socket, and returns its address.
func forwardProxy(t *testing.T, echo string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	file, err := ln.(*net.TCPListener).File()
	ln.Close() // the file holds its own descriptor of the socket
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	addr := ln.Addr().String()
	cmd := exec.Command(agentExe(), "proxy", "--listen", addr, "--listen-fd", "3", "--log-level", "warn", "--egress-allow", echo)
	cmd.ExtraFiles = []*os.File{file} // descriptor 3
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return addr
}
