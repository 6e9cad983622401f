package planner

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// TestValidateReadsFreshHeartbeats: an agent that announced itself an
// instant ago is a known provider even though the planner's watch of
// fleet-agents has not delivered its heartbeat (here: no watch runs at all).
func TestValidateReadsFreshHeartbeats(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := bustest.Start(t)
	p, err := New(c, Config{ID: "t"}, testLogger(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	p.agents.kv = kv
	spec := events.PoolSpec{Name: "fresh", Provider: "local", Size: 1, Targets: []string{"t2"}}
	spec.Normalize()
	if _, known, _ := (backend{p}).Targets(ctx, spec.Provider, spec.Targets); known {
		t.Fatal("a provider with no heartbeat at all was accepted")
	}
	for _, target := range []string{"t1", "t2"} {
		now := time.Now().UTC()
		b, _ := json.Marshal(agent.Heartbeat{Info: agent.Info{Entry: "local", Target: target, Type: "local"}, StartedAt: now, At: now})
		if _, err := kv.Put(ctx, agent.HeartbeatKey("local", target), b); err != nil {
			t.Fatal(err)
		}
	}
	if targets, known, _ := (backend{p}).Targets(ctx, spec.Provider, spec.Targets); !known || !targets["t2"] {
		t.Fatalf("fresh heartbeats were not read: known %v, targets %v", known, targets)
	}
}
