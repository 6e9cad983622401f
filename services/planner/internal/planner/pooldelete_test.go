package planner

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestPoolDeleteRemovesSecrets: pool.delete removes the pool's secrets
// from fleet-secrets; a repeated pool.delete (after a crash between the
// event and the removal) removes leftovers without appending; a late
// removal never takes the secrets of a later apply; re-applying the pool
// writes fresh secrets its proxies are created with.
func TestPoolDeleteRemovesSecrets(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	ctx := context.Background()
	const spec = `{"name":"demo","provider":"local","size":1,"userData":"#cloud-config\n","auth":{"username":"u","password":"pw-1"}}`
	h.ok(poolApply, spec, nil)
	h.requested(1)
	if _, err := h.secret.Get(ctx, "demo"); err != nil {
		t.Fatalf("secrets after apply: %v", err)
	}

	var pv api.PoolView
	h.ok(poolDelete, `{"name":"demo"}`, &pv)
	if !pv.Deleted || pv.Revision != 2 {
		t.Fatalf("delete reply: got %+v, want deleted at revision 2", pv)
	}
	if _, err := h.secret.Get(ctx, "demo"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("secrets after pool.delete: got %v, want %v", err, jetstream.ErrKeyNotFound)
	}
	if n := len(h.eventsOf(events.AggregatePool, events.PoolDeleted)); n != 1 {
		t.Fatalf("pool deleted events: got %d, want 1", n)
	}

	// The reconciler retires the deleted pool's proxy on its own; let it
	// finish before counting what the repeated delete appends.
	h.waitFor("the deleted pool's proxy retired", func() bool {
		return len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)) == 1
	})
	h.settle(r, 3)

	// As if the planner crashed after the deleted event: the secrets of
	// revision 1 are still there. A repeated delete removes them.
	putSecrets(t, h, "demo", events.PoolSecrets{Revision: 1, Password: "pw-1"})
	before := h.lastSeq(bus.EventsStream)
	h.ok(poolDelete, `{"name":"demo"}`, nil)
	if got := h.lastSeq(bus.EventsStream); got != before {
		t.Errorf("repeated delete appended: last seq %d, want %d", got, before)
	}
	if _, err := h.secret.Get(ctx, "demo"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("leftover secrets after the repeated pool.delete: got %v, want %v", err, jetstream.ErrKeyNotFound)
	}

	// Re-applying brings the pool back with fresh secrets, which reach the
	// new proxy's create command.
	h.ok(poolApply, strings.Replace(spec, "pw-1", "pw-2", 1), &pv)
	if pv.Deleted || pv.Revision != 3 {
		t.Fatalf("re-apply: got %+v, want revision 3, not deleted", pv)
	}
	ids, _ := h.requested(2)
	h.waitFor("create of the re-applied pool", func() bool {
		for _, c := range h.commandsOf(events.VerbCreate) {
			if c.Create.ProxyID == ids[1] {
				return true
			}
		}
		return false
	})
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.ProxyID == ids[1] && (c.Create.Auth == nil || c.Secrets.Password != "pw-2" || string(c.Secrets.UserData) != "#cloud-config\n") {
			t.Errorf("create of the re-applied pool: auth %+v user-data %q, want password pw-2 and the user-data", c.Create.Auth, c.Secrets.UserData)
		}
	}
	// A removal for the deletion at revision 2 that runs only now (a
	// pool.delete racing the re-apply) leaves revision 3's secrets alone.
	if aerr := (backend{r.Planner}).removeSecrets(ctx, "demo", 2); aerr != nil {
		t.Fatal(aerr)
	}
	e, err := h.secret.Get(ctx, "demo")
	if err != nil {
		t.Fatalf("secrets of revision 3 after a late removal of revision 2: %v", err)
	}
	var have events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &have); err != nil || have.Revision != 3 || have.Password != "pw-2" {
		t.Errorf("secrets: got %+v (%v), want revision 3 with pw-2", have, err)
	}
}

func putSecrets(t *testing.T, h *harness, pool string, s events.PoolSecrets) {
	t.Helper()
	b, _ := json.Marshal(s)
	if _, err := h.secret.Put(context.Background(), pool, b); err != nil {
		t.Fatal(err)
	}
}

// logRecorder keeps the messages a planner logs at warn or above.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelWarn }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Level.String()+" "+r.Message)
	return nil
}
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// TestDeletedPoolNeedsNoSecrets: a planner that takes the lead over a
// deleted pool (its secrets removed) with a proxy still requested retires
// the proxy without re-sending its create and without complaining about
// the missing secrets; a pool without secrets the same.
func TestDeletedPoolNeedsNoSecrets(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	ctx := context.Background()
	withSecrets := events.PoolSecrets{Password: "pw"}
	ids := map[string]string{}
	for pool, digest := range map[string]string{"secret": withSecrets.Digest([]byte("k")), "plain": ""} {
		spec := events.PoolSpec{Name: pool, Provider: "local", Size: 1, Port: events.DefaultProxyPort}
		if digest != "" {
			spec.Auth = &events.ProxyAuth{Username: "u"}
		}
		applied := events.PoolAppliedData{Spec: spec, Revision: 1, SecretsDigest: digest}
		if _, err := h.store.Append(ctx, events.AggregatePool, pool, events.PoolApplied, pool+".applied.1", applied, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
		id := events.NewProxyID(pool)
		ids[id] = pool
		req := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: spec.Port}}
		if _, err := h.store.Append(ctx, events.AggregateProxy, id, events.ProxyRequested, events.ProxyEventID(id, events.ProxyRequested, 1), req, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
		if _, err := h.store.Append(ctx, events.AggregatePool, pool, events.PoolDeleted, pool+".deleted.2", events.PoolDeletedData{Revision: 2}, nil); err != nil {
			t.Fatal(err)
		}
	}
	rec := &logRecorder{}
	r := h.startPlannerWith(Config{ID: "p1"}, nil, func(p *Planner) { p.log = slog.New(rec) })
	h.waitFor("leader", r.IsLeader)
	h.waitFor("both proxies retired", func() bool { return len(h.commandsOf(events.VerbDelete)) == 2 })
	h.settle(r, 3)
	for _, c := range h.commandsOf(events.VerbDelete) {
		if _, ok := ids[c.Delete.ProxyID]; !ok || c.Delete.Reason != "pool deleted" {
			t.Errorf("delete: got %+v, want one of %v with reason %q", c.Delete, ids, "pool deleted")
		}
	}
	if creates := h.commandsOf(events.VerbCreate); len(creates) != 0 {
		t.Errorf("create commands for deleted pools: got %d (%+v), want none", len(creates), creates[0].Create)
	}
	if logs := rec.all(); len(logs) != 0 {
		t.Errorf("warnings and errors: got %q, want none", logs)
	}
}
