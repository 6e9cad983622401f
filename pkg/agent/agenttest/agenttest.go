// Package agenttest runs agent runtimes in tests and waits on what they
// publish: [Serve] runs a process's runtimes until the test stops them,
// [WaitHeartbeat] watches fleet-agents for one runtime's heartbeat, and
// [Check] asks one runtime for its checks. [RunDriverConformance] is the
// suite every backend's tests run against the [agent.Driver] contract.
package agenttest

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Timeout bounds each wait of this package.
const Timeout = 30 * time.Second

// Serve runs run in its own goroutine until stop is called. stop ends
// run's context, waits for run to return and gives its error; it may be
// called more than once. The running context ends when run returns, early
// or after stop, so a wait on it never outlives run. A t.Cleanup stops run
// and reports an error the test did not collect.
func Serve(t testing.TB, run func(ctx context.Context) error) (running context.Context, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	running, returned := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		defer returned()
		errc <- run(ctx)
	}()
	var (
		once      sync.Once
		err       error
		collected bool
	)
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-errc:
			case <-time.After(Timeout):
				t.Errorf("still running %s after its context ended", Timeout)
			}
			collected = true
		})
		return err
	}
	t.Cleanup(func() {
		wasCollected := collected
		if e := stop(); e != nil && !wasCollected {
			t.Errorf("run: %v", e)
		}
	})
	return running, stop
}

// WaitHeartbeat waits for the heartbeat of the runtime of entry and target
// in the fleet-agents bucket and returns it. It fails t when ctx ends first
// or after [Timeout].
func WaitHeartbeat(ctx context.Context, t testing.TB, conn *bus.Conn, entry, target string) agent.Heartbeat {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	key := agent.HeartbeatKey(entry, target)
	kv, err := conn.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		t.Fatalf("bucket %s: %v", bus.BucketAgents, err)
	}
	w, err := kv.Watch(ctx, key)
	if err != nil {
		t.Fatalf("watch %s: %v", key, err)
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case e := <-w.Updates():
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue // the end of the initial values, or a delete
			}
			var hb agent.Heartbeat
			if err := json.Unmarshal(e.Value(), &hb); err != nil {
				t.Fatalf("heartbeat %s = %s: %v", key, e.Value(), err)
			}
			return hb
		case <-ctx.Done():
			t.Fatalf("no heartbeat %s in %s: %v (did the runtime stop?)", key, bus.BucketAgents, context.Cause(ctx))
		}
	}
}

// Check asks the runtime of entry and target for its checks (the
// fleet.agent.<entry>.<target>.check request) and returns its verdicts.
func Check(ctx context.Context, t testing.TB, conn *bus.Conn, entry, target string) []agent.Verdict {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	msg, err := conn.NC.RequestWithContext(ctx, events.AgentSubject(entry, target, events.AgentCheck), nil)
	if err != nil {
		t.Fatalf("check of %s.%s: %v", entry, target, err)
	}
	var verdicts []agent.Verdict
	if err := json.Unmarshal(msg.Data, &verdicts); err != nil {
		t.Fatalf("check of %s.%s answered %s: %v", entry, target, msg.Data, err)
	}
	return verdicts
}
