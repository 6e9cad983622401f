package local

import (
	"context"
	"errors"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

const testTarget = "test"

// runAgent runs the shared agent runtime with d against conn until the end
// of the test.
func runAgent(t *testing.T, conn *bus.Conn, d agent.Driver, allow ...netip.AddrPort) {
	t.Helper()
	rt, err := agent.New(conn, d, agent.Config{
		Info:            agent.Info{Entry: "local", Target: testTarget, Type: "local"},
		WatchInterval:   100 * time.Millisecond,
		EgressEndpoints: allow,
	}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runtime: %v", err)
		}
	})
}

func createCommand(proxyID string, auth *events.ProxyAuth) events.CreateCommand {
	return events.CreateCommand{
		ProxyID:   proxyID,
		ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: testTarget, Instance: events.InstanceName(proxyID), Revision: 1, Port: 3128},
		Attempt:   1,
		Auth:      auth,
	}
}

// waitEvent polls the proxy's events until one of kind appears and returns
// it; it fails on a failed event.
func waitEvent(t *testing.T, store *bus.EventStore, proxyID, kind string) bus.Event {
	t.Helper()
	var found *bus.Event
	eventually(t, "proxy "+proxyID+" event "+kind, func() bool {
		evs, err := store.Load(context.Background(), events.AggregateProxy, proxyID)
		if err != nil {
			t.Fatalf("load events: %v", err)
		}
		for i := range evs {
			if evs[i].Kind == events.ProxyFailed && kind != events.ProxyFailed {
				t.Fatalf("proxy failed: %s", evs[i].Data)
			}
			if evs[i].Kind == kind {
				found = &evs[i]
				return true
			}
		}
		return false
	})
	return *found
}

func runningAddress(t *testing.T, ev bus.Event) string {
	t.Helper()
	var run events.ProxyRunningData
	if err := ev.DecodeData(&run); err != nil || run.Address == "" {
		t.Fatalf("running event %s: %v, address %q", ev.Data, err, run.Address)
	}
	return run.Address
}

func TestRuntimeCreateAndDelete(t *testing.T) {
	conn := bustest.Start(t)
	o := origin(t)
	d := newDriver(t, Config{})
	runAgent(t, conn, d, endpoint(t, o))
	store := bus.NewEventStore(conn, "test", nil)
	ctx := ctxT(t)

	cmd := createCommand("demo-rt1", nil)
	if _, err := bus.PublishCreate(ctx, conn, "test", cmd, 0); err != nil {
		t.Fatal(err)
	}
	addr := runningAddress(t, waitEvent(t, store, cmd.ProxyID, events.ProxyRunning))
	wantServes(t, addr, o)
	pid := readState(t, d, cmd.Instance).PID

	del := events.DeleteCommand{ProxyID: cmd.ProxyID, Pool: cmd.Pool, Entry: cmd.Entry, Target: cmd.Target, Instance: cmd.Instance, Attempt: 1}
	if _, err := bus.PublishDelete(ctx, conn, "test", del, 0); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, store, cmd.ProxyID, events.ProxyDeleted)
	if !processGone(pid) {
		t.Fatalf("process %d still runs after the deleted event", pid)
	}
	if _, err := d.Get(ctx, agent.Ref{Name: cmd.Instance}); !errors.Is(err, agent.ErrNotFound) {
		t.Fatalf("Get after delete: %v, want ErrNotFound", err)
	}
}

func TestRuntimeCreateWithAuth(t *testing.T) {
	conn := bustest.Start(t)
	o := origin(t)
	d := newDriver(t, Config{})
	runAgent(t, conn, d, endpoint(t, o))
	store := bus.NewEventStore(conn, "test", nil)
	ctx := ctxT(t)

	cmd := createCommand("demo-rt2", &events.ProxyAuth{Username: "crawler", Password: "pa55word"})
	if _, err := bus.PublishCreate(ctx, conn, "test", cmd, 0); err != nil {
		t.Fatal(err)
	}
	addr := runningAddress(t, waitEvent(t, store, cmd.ProxyID, events.ProxyRunning))
	if code, _, _ := getVia(t, addr, "", "", o.URL+"/"); code != http.StatusProxyAuthRequired {
		t.Errorf("without credentials: %d, want 407", code)
	}
	if code, body, _ := getVia(t, addr, "crawler", "pa55word", o.URL+"/x"); code != http.StatusOK || body != "hello /x" {
		t.Errorf("with credentials: %d %q, want 200 %q", code, body, "hello /x")
	}
	evs, _ := store.Load(ctx, events.AggregateProxy, cmd.ProxyID)
	for _, ev := range evs {
		if strings.Contains(string(ev.Data), "pa55word") {
			t.Errorf("event %s carries the password: %s", ev.Kind, ev.Data)
		}
	}
}
