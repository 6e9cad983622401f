package local

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
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
	agenttest.Serve(t, rt.Run)
}

func createCommand(proxyID string, auth *events.ProxyAuth) events.CreateCommand {
	return events.CreateCommand{
		ProxyID:   proxyID,
		ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: testTarget, Instance: events.InstanceName(proxyID), Revision: 1, Port: 3128},
		Attempt:   1,
		Auth:      auth,
	}
}

// createRunning publishes cmd and returns the proxy's address once its
// running event is stored.
func createRunning(ctx context.Context, t *testing.T, conn *bus.Conn, store *bus.EventStore, cmd events.CreateCommand) string {
	t.Helper()
	if _, err := bus.PublishCreate(ctx, conn, "test", cmd, 0); err != nil {
		t.Fatal(err)
	}
	return waitRunning(t, store, cmd.ProxyID)
}

// waitRunning waits for the running event of proxy id and returns its
// address.
func waitRunning(t *testing.T, store *bus.EventStore, id string) string {
	t.Helper()
	return runningAddress(t, bustest.WaitEvent(t, 30*time.Second, store, id, events.ProxyRunning))
}

// deleteProxy publishes the delete of cmd's proxy and waits for its
// deleted event.
func deleteProxy(ctx context.Context, t *testing.T, conn *bus.Conn, store *bus.EventStore, cmd events.CreateCommand) {
	t.Helper()
	del := events.DeleteCommand{ProxyID: cmd.ProxyID, Pool: cmd.Pool, Entry: cmd.Entry, Target: cmd.Target, Instance: cmd.Instance, Attempt: 1}
	if _, err := bus.PublishDelete(ctx, conn, "test", del, 0); err != nil {
		t.Fatal(err)
	}
	bustest.WaitEvent(t, 30*time.Second, store, cmd.ProxyID, events.ProxyDeleted)
}

func runningAddress(t *testing.T, ev bus.Event) string {
	t.Helper()
	var run events.ProxyRunningData
	if err := ev.DecodeData(&run); err != nil || run.Address == "" {
		t.Fatalf("running event %s: %v, address %q", ev.Data, err, run.Address)
	}
	return run.Address
}

// startRuntime starts a bus and the agent runtime over a new driver whose
// proxies may reach the returned origin; store is the fleet's event store.
func startRuntime(t *testing.T) (conn *bus.Conn, o *httptest.Server, d *Driver, store *bus.EventStore) {
	t.Helper()
	conn = bustest.Start(t)
	o = origin(t)
	d = newDriver(t, Config{})
	runAgent(t, conn, d, endpoint(t, o))
	return conn, o, d, bus.NewEventStore(conn, "test", nil)
}

func TestRuntimeCreateAndDelete(t *testing.T) {
	conn, o, d, store := startRuntime(t)
	ctx := ctxT(t)

	cmd := createCommand("demo-rt1", nil)
	addr := createRunning(ctx, t, conn, store, cmd)
	wantServes(t, addr, o)
	pid := readState(t, d, cmd.Instance).PID

	deleteProxy(ctx, t, conn, store, cmd)
	if !processGone(pid) {
		t.Fatalf("process %d still runs after the deleted event", pid)
	}
	if _, err := d.Get(ctx, agent.Ref{Name: cmd.Instance}); !errors.Is(err, agent.ErrNotFound) {
		t.Fatalf("Get after delete: %v, want ErrNotFound", err)
	}
}

func TestRuntimeCreateWithAuth(t *testing.T) {
	conn, o, _, store := startRuntime(t)
	ctx := ctxT(t)

	cmd := createCommand("demo-rt2", &events.ProxyAuth{Username: "crawler", Password: "pa55word"})
	addr := createRunning(ctx, t, conn, store, cmd)
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
