package projection_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/projection"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// env is one test's NATS, event store and running projector.
type env struct {
	t    *testing.T
	ctx  context.Context
	conn *bus.Conn
	stop func()
}

func start(t *testing.T) *env {
	t.Helper()
	e := open(t)
	e.run()
	return e
}

// open starts NATS for one test, without a projector.
func open(t *testing.T) *env {
	t.Helper()
	return openFor(t, 60*time.Second)
}

// openFor is [open] for a test whose calls together may take up to
// within: one that does thousands of KV round trips, which a machine
// shared with other work (race detector on) makes slow.
func openFor(t *testing.T, within time.Duration) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	t.Cleanup(cancel)
	e := &env{t: t, ctx: ctx, conn: bustest.Start(t), stop: func() {}}
	t.Cleanup(func() { e.stop() })
	return e
}

// run starts a projector; stop ends it and waits for it.
func (e *env) run() {
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- projection.New(e.conn, nil, nil).Run(ctx) }()
	e.stop = func() {
		cancel()
		if err := <-done; err != nil {
			e.t.Errorf("projector: %v", err)
		}
		e.stop = func() {}
	}
}

func (e *env) append(id, kind string, data any) uint64 {
	e.t.Helper()
	agg := events.AggregateProxy
	if isPoolData(data) {
		agg = events.AggregatePool
	}
	seq, err := bus.NewEventStore(e.conn, bustest.Source(agg, kind), nil).Append(e.ctx, agg, id, kind, fmt.Sprintf("%s.%s.1.%d", id, kind, time.Now().UnixNano()), data, nil)
	if err != nil {
		e.t.Fatalf("append %s %s: %v", id, kind, err)
	}
	return seq
}

// stored appends an event as [env.append] does and returns it as stored,
// for [projection.Projector.ApplyBatch].
func (e *env) stored(id, kind string, data any) projection.Raw {
	e.t.Helper()
	seq := e.append(id, kind, data)
	st, err := e.conn.JS.Stream(e.ctx, bus.EventsStream)
	if err != nil {
		e.t.Fatal(err)
	}
	m, err := st.GetMsg(e.ctx, seq)
	if err != nil {
		e.t.Fatal(err)
	}
	return projection.Raw{Seq: seq, Subject: m.Subject, Data: m.Data}
}

func isPoolData(d any) bool {
	switch d.(type) {
	case events.PoolAppliedData, events.PoolDeletedData, events.PoolConditionData, events.PoolScaledData:
		return true
	}
	return false
}

func (e *env) eventTime(seq uint64) time.Time {
	e.t.Helper()
	st, err := e.conn.JS.Stream(e.ctx, bus.EventsStream)
	if err != nil {
		e.t.Fatal(err)
	}
	raw, err := st.GetMsg(e.ctx, seq)
	if err != nil {
		e.t.Fatal(err)
	}
	env, err := events.DecodeEnvelope(raw.Data)
	if err != nil {
		e.t.Fatal(err)
	}
	return env.Time.UTC()
}

// eventually polls cond until it holds or the test's deadline passes.
func (e *env) eventually(what string, cond func() bool) {
	e.t.Helper()
	if testwait.For(e.ctx, cond) != nil {
		e.t.Fatalf("timed out waiting for %s", what)
	}
}

// caughtUp waits until the projection consumer acknowledged the last event.
func (e *env) caughtUp() {
	e.t.Helper()
	e.eventually("projection to catch up", func() bool {
		st, err := e.conn.JS.Stream(e.ctx, bus.EventsStream)
		if err != nil {
			return false
		}
		si, err := st.Info(e.ctx)
		if err != nil {
			return false
		}
		cons, err := st.Consumer(e.ctx, projection.ConsumerName)
		if err != nil {
			return false
		}
		ci, err := cons.Info(e.ctx)
		if err != nil {
			return false
		}
		return ci.AckFloor.Stream >= si.State.LastSeq && ci.NumAckPending == 0
	})
}

func (e *env) proxy(id string) (projection.Proxy, bool) {
	e.t.Helper()
	var v projection.Proxy
	return v, e.get(bus.BucketProxies, id, &v)
}

func (e *env) get(bucket, key string, out any) bool {
	e.t.Helper()
	kv, err := e.conn.JS.KeyValue(e.ctx, bucket)
	if err != nil {
		e.t.Fatal(err)
	}
	entry, err := kv.Get(e.ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false
	}
	if err != nil {
		e.t.Fatal(err)
	}
	// Decode into a zero value: json.Unmarshal into a used value keeps
	// fields the new JSON omits (inside slice elements too).
	v := reflect.ValueOf(out).Elem()
	v.Set(reflect.Zero(v.Type()))
	if err := json.Unmarshal(entry.Value(), out); err != nil {
		e.t.Fatalf("%s/%s: %v", bucket, key, err)
	}
	return true
}

// waitProxy waits until the proxy's value records seq, and returns it.
func (e *env) waitProxy(id string, seq uint64) projection.Proxy {
	e.t.Helper()
	var v projection.Proxy
	e.eventually(fmt.Sprintf("%s at seq %d", id, seq), func() bool {
		var ok bool
		v, ok = e.proxy(id)
		return ok && v.Seq >= seq
	})
	return v
}

// dump returns every key and value of the two views.
func (e *env) dump() map[string][]byte {
	e.t.Helper()
	out := map[string][]byte{}
	for _, b := range []string{bus.BucketProxies, bus.BucketPools} {
		kv, err := e.conn.JS.KeyValue(e.ctx, b)
		if err != nil {
			e.t.Fatal(err)
		}
		keys, err := kv.Keys(e.ctx)
		if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
			e.t.Fatal(err)
		}
		for _, k := range keys {
			entry, err := kv.Get(e.ctx, k)
			if err != nil {
				e.t.Fatal(err)
			}
			out[b+"/"+k] = entry.Value()
		}
	}
	return out
}

// diffDumps fails t with each key whose value differs between the dumps
// (or that only one of them holds), in key order.
func diffDumps(t *testing.T, got, want map[string][]byte) {
	t.Helper()
	keys := maps.Clone(want)
	maps.Copy(keys, got)
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		if !bytes.Equal(got[k], want[k]) {
			t.Errorf("%s:\n got  %s\n want %s", k, got[k], want[k])
		}
	}
}

func requested(pool string) events.ProxyRequestedData {
	return events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: "t1", Instance: events.InstanceName("p1"), Revision: 1, Port: 3128}}
}

func TestProxyLifecycle(t *testing.T) {
	e := start(t)
	const id = "demo-p1"
	// The target's labels, recorded with the placement decision, stay on
	// the proxy through its whole life.
	labels := map[string]string{"region": "eu-west", "country": "de", "provider": "hetzner"}
	req := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 2, Port: 3128}, Username: "crawler",
		Labels: labels}
	s1 := e.append(id, events.ProxyRequested, req)
	t0 := e.eventTime(s1)
	want := projection.Proxy{
		ID: id, Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id),
		State: events.ProxyRequested, Revision: 2, Port: 3128, Username: "crawler", Attempt: 1,
		Labels: maps.Clone(labels), CreatedAt: t0, UpdatedAt: t0, Seq: s1,
	}
	check := func(step string, seq uint64) {
		t.Helper()
		got := e.waitProxy(id, seq)
		want.Seq, want.UpdatedAt = seq, e.eventTime(seq)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("after %s:\n got  %+v\n want %+v", step, got, want)
		}
	}
	check("requested", s1)
	if raw := e.dump()[bus.BucketProxies+"/"+id]; !bytes.Contains(raw, []byte(`"labels":{"country":"de","provider":"hetzner","region":"eu-west"}`)) {
		t.Fatalf("fleet-proxies/%s = %s, want the labels under \"labels\"", id, raw)
	}

	s := e.append(id, events.ProxyProvisioning, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), ProviderID: "pid-1", Attempt: 1})
	want.State, want.ProviderID = events.ProxyProvisioning, "pid-1"
	check("provisioning", s)

	s = e.append(id, events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:40001", Attempt: 1})
	want.State, want.Address = events.ProxyRunning, "127.0.0.1:40001"
	check("running", s)

	// A projector restart in the middle changes nothing: the durable
	// consumer resumes where it stopped.
	e.stop()
	s = e.append(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:40001", LatencyMS: 12, EgressIP: "192.0.2.7"})
	e.run()
	want.State, want.LatencyMS, want.EgressIP = events.ProxyReady, 12, "192.0.2.7"
	check("ready", s)

	s = e.append(id, events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "connect refused", Streak: 3})
	want.State, want.Reason, want.Streak, want.UnhealthySince = events.ProxyUnhealthy, "connect refused", 3, e.eventTime(s)
	check("unhealthy", s)

	s = e.append(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:40001", LatencyMS: 9, EgressIP: "192.0.2.7"})
	want.State, want.LatencyMS, want.Reason, want.Streak, want.UnhealthySince = events.ProxyReady, 9, "", 0, time.Time{}
	check("ready again", s)

	// A replacement requested for it is recorded on it, without moving
	// its sequence.
	repl := requested("demo")
	repl.Instance, repl.Replaces, repl.ReplaceReason = events.InstanceName("demo-p2"), id, "recycled by operator"
	s2 := e.append("demo-p2", events.ProxyRequested, repl)
	e.waitProxy("demo-p2", s2)
	got, _ := e.proxy(id)
	if got.ReplacedBy != "demo-p2" || got.ReplaceReason != "recycled by operator" || got.Seq != s {
		t.Fatalf("replaced proxy: got replacedBy %q reason %q seq %d, want demo-p2, recycled by operator, %d", got.ReplacedBy, got.ReplaceReason, got.Seq, s)
	}
	want.ReplacedBy, want.ReplaceReason = "demo-p2", "recycled by operator"

	s = e.append(id, events.ProxyRetiring, events.ProxyRetiringData{Reason: "pool scaled down"})
	want.State, want.Reason = events.ProxyRetiring, "pool scaled down"
	check("retiring", s)

	e.append(id, events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1})
	e.caughtUp()
	if v, ok := e.proxy(id); ok {
		t.Fatalf("after deleted: key still holds %+v", v)
	}
}

func TestFailedRecordsClassAndReason(t *testing.T) {
	e := start(t)
	e.append("p1", events.ProxyRequested, requested("demo"))
	e.append("p1", events.ProxyProvisioning, events.ProxyProvisioningData{Attempt: 1})
	s := e.append("p1", events.ProxyFailed, events.ProxyFailedData{Class: events.ClassQuota, Reason: "no capacity", Attempt: 1})
	got := e.waitProxy("p1", s)
	if got.State != events.ProxyFailed || got.FailureClass != events.ClassQuota || got.Reason != "no capacity" {
		t.Fatalf("got state %q class %q reason %q, want failed/quota/no capacity", got.State, got.FailureClass, got.Reason)
	}
	// A probe that raced the failure must not make the proxy look ready.
	e.append("p1", events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:1"})
	e.caughtUp()
	if got, _ := e.proxy("p1"); got.State != events.ProxyFailed || got.Seq != s {
		t.Fatalf("after a late ready: state %q seq %d, want failed at %d", got.State, got.Seq, s)
	}
}

func TestProvisioningAfterRunningKeepsAddress(t *testing.T) {
	e := start(t)
	e.append("p1", events.ProxyRequested, requested("demo"))
	e.append("p1", events.ProxyRunning, events.ProxyRunningData{Address: "10.0.0.5:3128", ProviderID: "vm-1", Attempt: 1})
	s := e.append("p1", events.ProxyProvisioning, events.ProxyProvisioningData{Attempt: 2})
	got := e.waitProxy("p1", s)
	if got.State != events.ProxyProvisioning || got.Address != "10.0.0.5:3128" || got.ProviderID != "vm-1" || got.Attempt != 2 {
		t.Fatalf("got state %q address %q providerID %q attempt %d; want provisioning, 10.0.0.5:3128, vm-1, 2",
			got.State, got.Address, got.ProviderID, got.Attempt)
	}
}

func TestBadEventsAreSkipped(t *testing.T) {
	e := start(t)
	e.append("p1", events.ProxyRequested, requested("demo"))
	raw := func(subject, body string) {
		t.Helper()
		if _, err := e.conn.JS.Publish(e.ctx, subject, []byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	// Each body names its writer's source, so it is its data that is tested.
	raw("fleet.evt.proxy.p1.running.local.t1", `{not json`)
	raw("fleet.evt.proxy.p1.teleported", `{"specversion":"1.0","id":"x1","source":"t","type":"proxyfleet.proxy.teleported.v1","time":"2026-01-01T00:00:00Z","data":{}}`)
	raw("fleet.evt.widget.w1.made", `{"specversion":"1.0","id":"x2","source":"t","type":"proxyfleet.widget.made.v1","time":"2026-01-01T00:00:00Z","data":{}}`)
	raw("fleet.evt.proxy.p1.running.local.t1", `{"specversion":"1.0","id":"x3","source":"proxyfleet/agent/local/t1","type":"proxyfleet.proxy.running.v1","time":"2026-01-01T00:00:00Z","data":{"address":42}}`)
	raw("fleet.evt.proxy.p2.requested", `{"specversion":"1.0","id":"x4","source":"proxyfleet/planner","type":"proxyfleet.proxy.requested.v1","time":"2026-01-01T00:00:00Z","data":{"pool":"BAD NAME"}}`)
	raw("fleet.evt.pool.demo.applied", `{"specversion":"1.0","id":"x5","source":"proxyfleet/planner","type":"proxyfleet.pool.applied.v1","time":"2026-01-01T00:00:00Z","data":{"spec":{"name":"demo"},"revision":0}}`)
	// A running event with a field added by a newer writer still applies.
	raw("fleet.evt.proxy.p1.running.local.t1", `{"specversion":"1.0","id":"x6","source":"proxyfleet/agent/local/t1","type":"proxyfleet.proxy.running.v1","time":"2026-01-01T00:00:00Z","newattr":"kept","data":{"address":"127.0.0.1:9","attempt":1,"zone":"new"}}`)
	s := e.append("p1", events.ProxyReady, events.ProxyReadyData{LatencyMS: 3})

	got := e.waitProxy("p1", s)
	if got.State != events.ProxyReady || got.Address != "127.0.0.1:9" {
		t.Fatalf("got state %q address %q, want ready at 127.0.0.1:9 (the address of x6)", got.State, got.Address)
	}
	e.caughtUp()
	d := e.dump()
	if len(d) != 1 {
		t.Fatalf("views hold %d keys (%v), want only proxy p1", len(d), keysOf(d))
	}
}

func keysOf(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func TestRetiringStaysRetiringUntilDeleted(t *testing.T) {
	e := start(t)
	e.append("p1", events.ProxyRequested, requested("demo"))
	e.append("p1", events.ProxyRetiring, events.ProxyRetiringData{Reason: "pool deleted"})
	s := e.append("p1", events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 1})
	got := e.waitProxy("p1", s)
	if got.State != events.ProxyRetiring || got.Reason != "pool deleted" || got.Address != "127.0.0.1:9" {
		t.Fatalf("running after retiring: got state %q reason %q address %q; want retiring, pool deleted, 127.0.0.1:9", got.State, got.Reason, got.Address)
	}
	if got.Probeable() {
		t.Fatal("a retiring proxy must not be probed")
	}
}

func TestLateEventsDoNotResurrectDeletedProxy(t *testing.T) {
	e := start(t)
	e.append("p1", events.ProxyRequested, requested("demo"))
	e.append("p1", events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9"})
	e.append("p1", events.ProxyRetiring, events.ProxyRetiringData{Reason: "scale down"})
	e.append("p1", events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1})
	e.append("p1", events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "late", Streak: 3})
	e.caughtUp()
	if v, ok := e.proxy("p1"); ok {
		t.Fatalf("deleted proxy came back: %+v", v)
	}
}

func TestPoolView(t *testing.T) {
	e := start(t)
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 3, Port: 3128, Auth: &events.ProxyAuth{Username: "u", Password: "hunter2"}, UserData: "#cloud-config"}
	s1 := e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec.Public(), Revision: 1, SecretsDigest: spec.Secrets().Digest([]byte("k"))})
	var got projection.Pool
	e.eventually("pool demo", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == s1 })
	t1 := e.eventTime(s1)
	want := projection.Pool{Name: "demo", Provider: "local", Size: 3, Spec: spec.Public(), Revision: 1,
		SecretsDigest: spec.Secrets().Digest([]byte("k")), CreatedAt: t1, UpdatedAt: t1, Seq: s1}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("applied:\n got  %+v\n want %+v", got, want)
	}
	// Conditions: since moves only when the status changes.
	placedFalse := events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionFalse, Reason: events.ReasonNoLiveTarget, Message: "no live agent of entry local"}
	c1 := e.append("demo", events.PoolCondition, placedFalse)
	placedFalse.Message = "no live agent of entry local; targets considered, none alive: t1"
	c2 := e.append("demo", events.PoolCondition, placedFalse)
	e.eventually("condition", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == c2 })
	if len(got.Conditions) != 1 || got.Conditions[0].Message != placedFalse.Message || !got.Conditions[0].Since.Equal(e.eventTime(c1)) {
		t.Fatalf("conditions: got %+v, want Placed False since the first event (%v) with the second message", got.Conditions, e.eventTime(c1))
	}
	c3 := e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced})
	c4 := e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionFalse, Reason: events.ReasonNotEnoughReady})
	e.eventually("conditions", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == c4 })
	wantConds := []events.Condition{
		{Type: events.ConditionReady, Status: events.ConditionFalse, Reason: events.ReasonNotEnoughReady, Since: e.eventTime(c4)},
		{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced, Since: e.eventTime(c3)},
	}
	if !sameJSON(got.Conditions, wantConds) {
		j1, _ := json.Marshal(got.Conditions)
		j2, _ := json.Marshal(wantConds)
		t.Fatalf("conditions:\n got  %s\n want %s", j1, j2)
	}
	spec.Size = 1
	s2 := e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec.Public(), Revision: 2})
	e.eventually("pool demo revision 2", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == s2 })
	if got.Size != 1 || got.Revision != 2 || !got.CreatedAt.Equal(t1) || got.Spec.Auth == nil || got.Spec.Auth.Password != "" {
		t.Fatalf("re-applied: got %+v, want size 1, revision 2, createdAt %v, username only", got, t1)
	}
	if !sameJSON(got.Conditions, wantConds) {
		t.Fatalf("conditions after a re-apply:\n got  %+v\n want %+v", got.Conditions, wantConds)
	}
	e.append("demo", events.PoolDeleted, events.PoolDeletedData{Revision: 3})
	e.caughtUp()
	if e.get(bus.BucketPools, "demo", &got) {
		t.Fatalf("deleted pool still in view: %+v", got)
	}
}

// TestAutoscaledPoolView: fleet-pools shows the size the planner's last
// scaled event set and why; a re-apply keeps it within the new bounds, and
// a pool without autoscale wants its size again.
func TestAutoscaledPoolView(t *testing.T) {
	e := start(t)
	spec := events.PoolSpec{Name: "web", Provider: "local", Size: 1, Port: 3128,
		Autoscale: &events.Autoscale{Min: 2, Max: 10, TargetConnections: 4, ScaleDownAfter: events.Duration(time.Minute)}}
	var got projection.Pool
	wait := func(seq uint64) {
		t.Helper()
		e.eventually(fmt.Sprintf("pool web at seq %d", seq), func() bool { return e.get(bus.BucketPools, "web", &got) && got.Seq == seq })
	}
	wait(e.append("web", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1}))
	if got.Size != 2 || got.ScaleReason != "" || got.Spec.Autoscale == nil || *got.Spec.Autoscale != *spec.Autoscale {
		t.Fatalf("applied with size 1 under min 2: got size %d, reason %q, autoscale %+v; want 2, none, the spec's", got.Size, got.ScaleReason, got.Spec.Autoscale)
	}
	up := events.PoolScaledData{Size: 10, Previous: 2, Reason: "autoscale: 37 connections for 10 proxies"}
	s2 := e.append("web", events.PoolScaled, up)
	wait(s2)
	if got.Size != 10 || got.ScaleReason != up.Reason || !got.ScaledAt.Equal(e.eventTime(s2)) {
		t.Fatalf("scaled up: got size %d, reason %q at %v; want 10, %q at %v", got.Size, got.ScaleReason, got.ScaledAt, up.Reason, e.eventTime(s2))
	}
	spec.Autoscale.Max = 8
	wait(e.append("web", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 2}))
	if got.Size != 8 || got.ScaleReason != up.Reason || got.Revision != 2 {
		t.Fatalf("re-applied with max 8: got size %d, reason %q, revision %d; want 8, %q, 2", got.Size, got.ScaleReason, got.Revision, up.Reason)
	}
	down := events.PoolScaledData{Size: 2, Previous: 8, Reason: "autoscale: 0 connections for 2 proxies after 1m0s of low demand"}
	wait(e.append("web", events.PoolScaled, down))
	if got.Size != 2 || got.ScaleReason != down.Reason {
		t.Fatalf("scaled down: got size %d, reason %q; want 2, %q", got.Size, got.ScaleReason, down.Reason)
	}
	spec.Autoscale = nil
	s5 := e.append("web", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 3})
	wait(s5)
	if got.Size != 1 || got.ScaleReason != "" || !got.ScaledAt.IsZero() {
		t.Fatalf("autoscale off: got size %d, reason %q at %v; want its size 1 and no reason", got.Size, got.ScaleReason, got.ScaledAt)
	}
	// A scaled event for a pool without autoscale changes nothing.
	e.append("web", events.PoolScaled, up)
	e.caughtUp()
	if !e.get(bus.BucketPools, "web", &got) || got.Size != 1 || got.Seq != s5 {
		t.Fatalf("stray scaled event: got size %d at seq %d, want 1 at %d", got.Size, got.Seq, s5)
	}
}

// history appends a varied log: pools (one with auth), proxies in every
// state, a provisioning after running, a deletion and bad events.
func history(e *env) {
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 2, Port: 3128, Auth: &events.ProxyAuth{Username: "u"}}
	e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
	e.append("other", events.PoolApplied, events.PoolAppliedData{Spec: events.PoolSpec{Name: "other", Provider: "local", Size: 1, Port: 3128}, Revision: 1})
	e.append("other", events.PoolCondition, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionFalse, Reason: events.ReasonCapacityExhausted, Message: "t1 (1 of 1)"})
	e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady})
	auto := events.PoolSpec{Name: "auto", Provider: "local", Size: 3, Port: 3128, Autoscale: &events.Autoscale{Min: 2, Max: 10, TargetConnections: 4}}
	e.append("auto", events.PoolApplied, events.PoolAppliedData{Spec: auto, Revision: 1})
	e.append("auto", events.PoolScaled, events.PoolScaledData{Size: 10, Previous: 3, Reason: "autoscale: 37 connections for 10 proxies"})
	auto.Autoscale.Max = 8
	e.append("auto", events.PoolApplied, events.PoolAppliedData{Spec: auto, Revision: 2})
	for i, last := range []string{events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy, events.ProxyFailed, events.ProxyRetiring, events.ProxyDeleted} {
		id := fmt.Sprintf("demo-%d", i)
		e.append(id, events.ProxyRequested, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128}, Username: "u",
			Labels: map[string]string{"region": fmt.Sprintf("r%d", i%3), "provider": "p"}})
		steps := []struct {
			kind string
			data any
		}{
			{events.ProxyProvisioning, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), Attempt: 1}},
			{events.ProxyRunning, events.ProxyRunningData{Address: fmt.Sprintf("127.0.0.1:%d", 41000+i), Attempt: 1}},
			{events.ProxyReady, events.ProxyReadyData{Address: fmt.Sprintf("127.0.0.1:%d", 41000+i), LatencyMS: int64(i), EgressIP: "192.0.2.1"}},
			{events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "timeout", Streak: 3}},
			{events.ProxyFailed, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "gone", Attempt: 1}},
			{events.ProxyRetiring, events.ProxyRetiringData{Reason: "replace failed"}},
			{events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1}},
		}
		for _, st := range steps {
			if i == 0 {
				break
			}
			e.append(id, st.kind, st.data)
			if st.kind == last {
				break
			}
		}
	}
	e.append("demo-2", events.ProxyProvisioning, events.ProxyProvisioningData{Attempt: 2})
	if _, err := e.conn.JS.Publish(e.ctx, "fleet.evt.proxy.demo-1.running.local.t1", []byte("garbage")); err != nil {
		e.t.Fatal(err)
	}
	e.append("demo-1", events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:42000", Attempt: 1})
}

func TestRedeliveryChangesNothing(t *testing.T) {
	e := start(t)
	history(e)
	e.caughtUp()
	before := e.dump()
	if len(before) < 8 {
		t.Fatalf("views hold only %d keys: %v", len(before), keysOf(before))
	}
	e.stop()

	// Deliver every event a second time, as a crash before the ack would,
	// each on top of the final views: none may change anything.
	st, err := e.conn.JS.Stream(e.ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := projection.New(e.conn, nil, nil)
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		raw, err := st.GetMsg(e.ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Apply(e.ctx, seq, raw.Subject, raw.Data); err != nil {
			t.Fatalf("re-apply %d: %v", seq, err)
		}
		if after := e.dump(); !reflect.DeepEqual(after, before) {
			t.Errorf("re-applying event %d (%s) changed the views", seq, raw.Subject)
			diffDumps(t, after, before)
			return
		}
	}
}

func TestRebuildGivesIdenticalViews(t *testing.T) {
	e := start(t)
	history(e)
	e.caughtUp()
	before := e.dump()
	if len(before) < 8 || before["fleet-pools/demo"] == nil || before["fleet-pools/other"] == nil {
		t.Fatalf("views hold only %v", keysOf(before))
	}
	if !bytes.Contains(before["fleet-pools/auto"], []byte(`"size":8,"scaleReason":"autoscale: 37 connections for 10 proxies"`)) {
		t.Fatalf("autoscaled pool: got %s, want size 8 (scaled to 10, then max 8) with its reason", before["fleet-pools/auto"])
	}
	e.stop()

	if err := projection.Rebuild(e.ctx, e.conn); err != nil {
		t.Fatalf("rebuild: %v", err)
	}
	if d := e.dump(); len(d) != 0 {
		t.Fatalf("after dropping the views they still hold %v", keysOf(d))
	}
	if _, err := e.conn.JS.Consumer(e.ctx, bus.EventsStream, projection.ConsumerName); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Fatalf("consumer after rebuild: got %v, want ErrConsumerNotFound", err)
	}
	// Replay drops again and projects the whole log, returning when done.
	if err := projection.Replay(e.ctx, e.conn, nil); err != nil {
		t.Fatalf("replay: %v", err)
	}
	diffDumps(t, e.dump(), before)

	// A projector started afterwards resumes at the end: nothing changes.
	e.run()
	e.caughtUp()
	diffDumps(t, e.dump(), before)
}

// sameJSON compares values as their JSON (times compare by instant and
// zone text, not by monotonic reading).
func sameJSON(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

// TestPoolViewShowsStuckDeletes: the planner's Cleanup condition (deletes
// that keep failing) shows in fleet-pools, after the other conditions.
func TestPoolViewShowsStuckDeletes(t *testing.T) {
	e := start(t)
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Port: 3128}
	e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec.Public(), Revision: 1})
	stuck := events.PoolConditionData{Type: events.ConditionCleanup, Status: events.ConditionFalse, Reason: events.ReasonDeleteStuck,
		Message: "deletes keep failing, their instances may still run: px-a on local/t1 (retiring since 2026-01-01T00:00:00Z)"}
	c1 := e.append("demo", events.PoolCondition, stuck)
	c2 := e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady})
	var got projection.Pool
	e.eventually("conditions", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == c2 })
	want := []events.Condition{
		{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady, Since: e.eventTime(c2)},
		{Type: events.ConditionCleanup, Status: events.ConditionFalse, Reason: events.ReasonDeleteStuck, Message: stuck.Message, Since: e.eventTime(c1)},
	}
	if !sameJSON(got.Conditions, want) {
		j1, _ := json.Marshal(got.Conditions)
		j2, _ := json.Marshal(want)
		t.Fatalf("conditions:\n got  %s\n want %s", j1, j2)
	}
}
