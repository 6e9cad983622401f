package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/console/internal/fleetview"
	"proxyfleet/services/console/internal/tail"
	"proxyfleet/services/console/internal/traffic"
)

// TestConsoleIdentityLeastPrivilege runs deploy/nats as shipped, with
// generated keys, and connects as the console's identity: it follows
// every view, the event log and the request log and calls the API it
// offers, and it cannot read fleet-secrets (nor the sealed credentials or
// the gateways' CA key), write a bucket, append an event, command an agent
// or call the API's other endpoints.
func TestConsoleIdentityLeastPrivilege(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	url, secrets, admin := bustest.DeployFleet(t, ctx, filepath.Join("..", "..", "..", "..", "deploy", "nats"))
	put := func(bucket, key string, v any) {
		t.Helper()
		kv, err := admin.JS.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(v)
		if _, err := kv.Put(ctx, key, b); err != nil {
			t.Fatal(err)
		}
	}
	const secret = "s3cret-password-in-the-secrets-bucket"
	put(bus.BucketSecrets, "demo", events.PoolSecrets{Revision: 1, Password: secret})
	put(bus.BucketPools, "demo", map[string]any{"name": "demo", "provider": "local", "size": 2, "spec": events.PoolSpec{Name: "demo", Provider: "local", Size: 2}})
	put(bus.BucketProxies, "demo-a", events.ProxyView{ID: "demo-a", Pool: "demo", State: events.ProxyReady})
	put(bus.BucketProbes, "demo-a", map[string]any{"ok": true, "latencyMs": 7})
	put(bus.BucketAgents, "local.t1", map[string]any{"entry": "local", "target": "t1", "type": "local"})
	put(bus.BucketTargets, "local.t1", map[string]any{"entry": "local", "target": "t1", "ok": true})
	put(bus.BucketDemand, "demo.gw-1", events.GatewayDemand{Pool: "demo", Gateway: "gw-1", RequestsPerSecond: 4, At: time.Now()})
	put(bus.BucketHealth, "health-1", map[string]any{"replica": "health-1"})
	put(bus.BucketGatewayCooldowns, events.CooldownKey("demo-a", "example.com"), events.GatewayCooldown{Proxy: "demo-a", Pool: "demo", Site: "example.com", Rule: "captcha", Until: time.Now().Add(time.Hour)})
	store := bus.NewEventStore(admin, "planner", nil)
	if _, err := store.Append(ctx, events.AggregatePool, "demo", events.PoolDeleted, "demo.deleted.1", events.PoolDeletedData{Revision: 1}, nil); err != nil {
		t.Fatal(err)
	}
	rec, _ := json.Marshal(events.GatewayRequest{Time: time.Now(), Gateway: "gw-1", Pool: "demo", Site: "example.com", Proxies: []string{"demo-a"}, Outcome: events.RequestError})
	if _, err := admin.JS.Publish(ctx, events.GatewayLogSubject("gw-1"), rec); err != nil {
		t.Fatal(err)
	}

	console := bustest.ConnectAs(t, ctx, url, secrets, "console")

	// What the console does, it may.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	views := fleetview.New()
	tl := tail.New(0, nil)
	stats := traffic.New()
	done := make(chan struct{}, 3)
	go func() { _ = fleetview.NewFollower(console.JS, views, time.Second, nil).Run(rctx); done <- struct{}{} }()
	go func() { _ = tail.NewFollower(console, tl, 100, nil).Run(rctx); done <- struct{}{} }()
	go func() { _ = traffic.NewFollower(console.JS, stats, nil).Run(rctx); done <- struct{}{} }()
	defer func() { cancel(); <-done; <-done; <-done }()
	testwait.Until(t, 20*time.Second, "every view followed under the console's identity", func() bool {
		for _, b := range fleetview.Buckets() {
			if !views.Synced(b) {
				return false
			}
		}
		sum, ok := views.Pool("demo", time.Now())
		ts, health := views.Targets()
		return ok && sum.Counts.Ready == 1 && sum.RequestsPerSecond == 4 && len(ts) == 1 && ts[0].Check != nil && ts[0].Agent != nil && len(health) == 1 &&
			len(views.Cooldowns("demo-a", time.Now())) == 1
	})
	testwait.Until(t, 20*time.Second, "the event log and the request log read", func() bool {
		return len(tl.Last(10, "demo", "")) == 1 && stats.Pools()["demo"].Failures == 1
	})

	// The API endpoints it calls reach the planner (here a responder under
	// the planner's identity); the others do not.
	planner := bustest.ConnectAs(t, ctx, url, secrets, "planner")
	served := make(chan string, 10)
	sub, err := planner.NC.Subscribe("fleet.api.>", func(m *nats.Msg) {
		served <- m.Subject
		_ = m.Respond([]byte(`{"name":"demo"}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := planner.NC.Flush(); err != nil {
		t.Fatal(err)
	}
	client := api.NewClient(console.NC, api.WithTimeout(2*time.Second))
	if pv, err := client.PoolGet(ctx, "demo"); err != nil || pv.Name != "demo" {
		t.Fatalf("the console cannot get a pool: %+v, %v", pv, err)
	}
	<-served
	if _, err := client.ProxyDelete(ctx, api.ProxyDeleteRequest{ID: "demo-a"}); err == nil {
		t.Fatal("the console may delete a proxy (proxy.delete), which it never offers")
	}
	if _, err := client.InstanceDelete(ctx, api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: "px-x"}); err == nil {
		t.Fatal("the console may delete an instance")
	}
	select {
	case s := <-served:
		t.Fatalf("a request the console may not send reached the planner: %s", s)
	default:
	}

	// No secret, sealed or not.
	// A refused request is dropped by the server, so it ends by timing
	// out: a second is plenty on loopback.
	short := func() context.Context {
		c, cancel := context.WithTimeout(ctx, time.Second)
		t.Cleanup(cancel)
		return c
	}
	for _, bucket := range []string{bus.BucketSecrets, bus.BucketProbeCreds, bus.BucketGatewayCreds} {
		if kv, err := console.JS.KeyValue(short(), bucket); err == nil {
			if e, err := kv.Get(short(), "demo"); err == nil {
				t.Fatalf("the console read %s: %q", bucket, e.Value())
			}
			if w, err := kv.WatchAll(short()); err == nil {
				select {
				case e := <-w.Updates():
					if e != nil {
						t.Fatalf("the console watched %s: %q", bucket, e.Value())
					}
				case <-time.After(time.Second):
				}
				bus.StopWatch(w)
			}
		}
	}
	msg, err := console.NC.RequestWithContext(short(), "$JS.API.DIRECT.GET.KV_"+bus.BucketSecrets+".$KV."+bus.BucketSecrets+".demo", nil)
	if err == nil && strings.Contains(string(msg.Data), "s3cret") {
		t.Fatal("the console read fleet-secrets by direct get")
	}
	if _, err := console.NC.RequestWithContext(short(), "$JS.API.DIRECT.GET.KV_"+bus.BucketGatewayCA+".$KV."+bus.BucketGatewayCA+".key", nil); err == nil {
		t.Fatal("the console may direct-get the gateways' CA key")
	}

	// No writes: no bucket, no event, no command.
	kv, err := console.JS.KeyValue(ctx, bus.BucketPools)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(short(), "evil", []byte(`{}`)); err == nil {
		t.Fatal("the console may write fleet-pools")
	}
	cstore := bus.NewEventStore(console, "console", nil)
	if _, err := cstore.Append(short(), events.AggregatePool, "demo", events.PoolDeleted, "demo.deleted.2", events.PoolDeletedData{Revision: 2}, nil); err == nil {
		t.Fatal("the console may append an event")
	}
	if _, err := bus.PublishCreate(short(), console, "console", events.CreateCommand{ProxyID: "x-1", ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName("x-1"), Port: 1}, Attempt: 1}, 0); err == nil {
		t.Fatal("the console may publish a command")
	}
	if err := bus.EnsureTopology(short(), console); err == nil {
		t.Fatal("the console may create the topology")
	}
}
