package bus_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// One writer cannot suppress another's events. JetStream deduplicates by
// Nats-Msg-Id across the whole stream, and event ids are deterministic
// ("p1.unhealthy.1"): an agent that publishes, on a subject it may
// publish on, a message with the Msg-Id health is about to use must not
// turn health's append into a silent duplicate. Health's own retries,
// from the same process or after a restart with the same credentials,
// still deduplicate.
func TestMsgIDsCannotBeForgedByOtherWriters(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Second)
	srv := bustest.Server(t, &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{{Username: "health", Password: "health-pw"}, {Username: "agent", Password: "agent-pw"}}})
	dial := func(user, password string) *bus.Conn {
		t.Helper()
		c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), User: user, Password: password, Name: user}, nil)
		if err != nil {
			t.Fatalf("connect as %s: %v", user, err)
		}
		t.Cleanup(c.Close)
		return c
	}
	hc := dial("health", "health-pw")
	if err := bus.EnsureTopology(ctx, hc); err != nil {
		t.Fatal(err)
	}
	ac := dial("agent", "agent-pw")
	health := bus.NewEventStore(hc, events.SourceHealth, nil)
	st, err := hc.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}

	// The attacker knows the scheme and the event's id. It publishes on its
	// own observation subject with every Msg-Id it can compute: the bare
	// id, and the id marked under its own key (its own store's append).
	const id, msgID = "p1", "p1.unhealthy.1"
	bustest.AppendOn(t, ac, events.ObservationSubject(id, events.ProxyRunning, "local", "t1"), events.AgentSource("local", "t1"),
		events.AggregateProxy, id, events.ProxyRunning, msgID, events.ProxyRunningData{Address: "127.0.0.1:1"})
	forger := bus.NewEventStore(ac, events.AgentSource("local", "t1"), nil)
	if _, err := forger.Append(ctx, events.AggregateProxy, id, events.ProxyRunning, msgID, events.ProxyRunningData{Address: "127.0.0.1:1"}, nil); err != nil {
		t.Fatal(err)
	}

	data := events.ProxyUnhealthyData{Reason: "probe failed"}
	seq, err := health.Append(ctx, events.AggregateProxy, id, events.ProxyUnhealthy, msgID, data, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetMsg(ctx, seq)
	if err != nil {
		t.Fatal(err)
	}
	if want := events.EventSubject(events.AggregateProxy, id, events.ProxyUnhealthy); m.Subject != want {
		t.Fatalf("health's append was answered with sequence %d, a message on %s: suppressed by the forged Msg-Id (want one on %s)", seq, m.Subject, want)
	}
	got := m.Header.Get(jetstream.MsgIDHeader)
	if !strings.HasPrefix(got, msgID+"~") {
		t.Errorf("stored Msg-Id %q: want the event's id %s and its writer's mark", got, msgID)
	}

	// Health's retries deduplicate: in this process, and after a restart
	// (a new connection with the same credentials).
	for _, s := range []*bus.EventStore{health, bus.NewEventStore(dial("health", "health-pw"), events.SourceHealth, nil)} {
		again, err := s.Append(ctx, events.AggregateProxy, id, events.ProxyUnhealthy, msgID, data, nil)
		if err != nil || again != seq {
			t.Fatalf("retry of health's append: (%d, %v), want its first sequence %d", again, err, seq)
		}
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 3 {
		t.Errorf("stream holds %d messages; want 3 (two forged, health's one)", info.State.Msgs)
	}
}

// An embedding service's own client gets a new nkey at every start, so
// the key of its Msg-Ids is kept in its data directory, readable by it
// alone: the planner's retries after a restart still deduplicate.
func TestEmbeddedServerKeepsItsMsgIDKey(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Second)
	dir := t.TempDir()
	conf := filepath.Join(t.TempDir(), "server.conf")
	if err := os.WriteFile(conf, []byte(`authorization { users: [ { user: ops, password: "ops-pw" } ] }`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func() (*bus.Conn, uint64) {
		t.Helper()
		c, err := bus.Connect(ctx, bus.Config{DataDir: dir, Listen: "127.0.0.1:-1", ServerConfig: conf, Embed: embedded.Start, Name: "planner"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := bus.EnsureTopology(ctx, c); err != nil {
			c.Close()
			t.Fatal(err)
		}
		seq, err := bus.NewEventStore(c, events.SourcePlanner, nil).Append(ctx, events.AggregatePool, "demo", events.PoolDeleted, "demo.deleted.1", struct{}{}, nil)
		if err != nil {
			c.Close()
			t.Fatal(err)
		}
		return c, seq
	}
	c, first := start()
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetMsg(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	if id := m.Header.Get(jetstream.MsgIDHeader); !strings.HasPrefix(id, "demo.deleted.1~") {
		t.Errorf("Msg-Id %q under an authenticating server: want the id and its writer's mark", id)
	}
	c.Close()
	key := filepath.Join(dir, "event-id.key")
	fi, err := os.Stat(key)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("%s has mode %v, want 0600", key, fi.Mode().Perm())
	}
	before, _ := os.ReadFile(key)

	c, again := start()
	defer c.Close()
	if again != first {
		t.Errorf("the same append after a restart stored sequence %d, want a duplicate of %d", again, first)
	}
	if after, _ := os.ReadFile(key); !bytes.Equal(before, after) {
		t.Error("the key changed across a restart")
	}
}
