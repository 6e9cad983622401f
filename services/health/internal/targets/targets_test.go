package targets_test

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/targets"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// checkDriver is a driver whose only real answer is Check.
type checkDriver struct{ verdicts []agent.Verdict }

func (d checkDriver) Create(context.Context, agent.Spec) (agent.Instance, error) {
	return agent.Instance{}, agent.ErrPermanent
}
func (d checkDriver) Get(context.Context, agent.Ref) (agent.Instance, error) {
	return agent.Instance{}, agent.ErrNotFound
}
func (d checkDriver) Delete(context.Context, agent.Ref) error        { return nil }
func (d checkDriver) List(context.Context) ([]agent.Instance, error) { return nil, nil }
func (d checkDriver) Check(context.Context) []agent.Verdict          { return d.verdicts }

func TestCheckAllRecordsEveryAgent(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)

	// A real agent runtime answering its check.
	verdicts := []agent.Verdict{{Check: "disk", OK: true}, {Check: "squid", OK: false, Detail: "not installed"}}
	rt, err := agent.New(c, checkDriver{verdicts}, agent.Config{Info: agent.Info{Entry: "local", Target: "host1", Type: "local"}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = rt.Run(rctx) }()
	defer func() { stop(); wg.Wait() }()

	agents, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	beat := func(entry, target string) {
		b, _ := json.Marshal(agent.Heartbeat{Info: agent.Info{Entry: entry, Target: target}, At: time.Now()})
		if _, err := agents.Put(ctx, agent.HeartbeatKey(entry, target), b); err != nil {
			t.Fatal(err)
		}
	}
	// An agent that listens but never answers, and one that is not there.
	beat("kvm", "silent")
	sub, err := c.NC.SubscribeSync(events.AgentSubject("kvm", "silent", events.AgentCheck))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	beat("kvm", "gone")
	// External proxies have no agent: a heartbeat claiming their entry
	// is not checked (nor recorded as a target that does not answer).
	beat(events.ProviderExternal, "external")

	out, err := c.JS.KeyValue(ctx, bus.BucketTargets)
	if err != nil {
		t.Fatal(err)
	}
	// A record of an agent that is no longer live is removed.
	if _, err := out.Put(ctx, "old.target", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := agents.Get(ctx, "local.host1"); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the agent never heartbeat")
		case <-time.After(10 * time.Millisecond):
		}
	}

	// The live agent must answer within the timeout even on a busy
	// machine; the silent one waits it out (the checks run concurrently).
	ch := targets.New(c, targets.Config{Timeout: 3 * time.Second}, nil)
	if err := ch.CheckAll(ctx); err != nil {
		t.Fatal(err)
	}
	get := func(key string) (targets.Record, bool) {
		t.Helper()
		e, err := out.Get(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return targets.Record{}, false
		}
		if err != nil {
			t.Fatal(err)
		}
		var r targets.Record
		if err := json.Unmarshal(e.Value(), &r); err != nil {
			t.Fatal(err)
		}
		return r, true
	}

	ok, found := get("local.host1")
	if !found || !reflect.DeepEqual(ok.Verdicts, verdicts) || ok.Error != "" || ok.OK || ok.Entry != "local" || ok.Target != "host1" || ok.At.IsZero() {
		t.Fatalf("local.host1: got %+v (found %v), want the agent's verdicts, not ok", ok, found)
	}
	silent, _ := get("kvm.silent")
	if !strings.Contains(silent.Error, "did not answer") || silent.OK {
		t.Fatalf("kvm.silent: got %+v, want a timeout error", silent)
	}
	if m, err := sub.NextMsg(time.Second); err != nil || m.Subject != events.AgentSubject("kvm", "silent", events.AgentCheck) {
		t.Fatalf("the silent agent was not asked: %v", err)
	}
	gone, _ := get("kvm.gone")
	if !strings.Contains(gone.Error, "no agent answers") {
		t.Fatalf("kvm.gone: got %+v, want a no-responders error", gone)
	}
	if r, found := get(agent.HeartbeatKey(events.ProviderExternal, "external")); found {
		t.Fatalf("the external entry was checked as an agent's target: %+v", r)
	}
	if r, found := get("old.target"); found {
		t.Fatalf("old.target still recorded: %+v", r)
	}
}

// A listing of fleet-agents can miss a heartbeat that is being rewritten
// as it runs (its end-of-listing mark may come early). The record of such
// an agent stays: while three agents beat as fast as they can, every round
// of checks leaves all three records in place.
func TestCheckAllKeepsRecordsOfAgentsBeatingDuringTheListing(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	c := bustest.Start(t)
	agents, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	out, err := c.JS.KeyValue(ctx, bus.BucketTargets)
	if err != nil {
		t.Fatal(err)
	}
	hosts := []string{"h1", "h2", "h3"}
	beat := func(target string) error {
		b, _ := json.Marshal(agent.Heartbeat{Info: agent.Info{Entry: "kvm", Target: target}, At: time.Now()})
		_, err := agents.Put(ctx, agent.HeartbeatKey("kvm", target), b)
		return err
	}
	for _, h := range hosts {
		if err := beat(h); err != nil {
			t.Fatal(err)
		}
	}
	// No agent answers: each check ends at once with no responders.
	ch := targets.New(c, targets.Config{Timeout: 3 * time.Second}, nil)
	if err := ch.CheckAll(ctx); err != nil {
		t.Fatal(err)
	}

	defer bustest.Rewriters(t, hosts, beat)()

	const rounds = 100
	lost := 0
	for i := range rounds {
		if err := ch.CheckAll(ctx); err != nil {
			t.Fatal(err)
		}
		for _, h := range hosts {
			if _, err := out.Get(ctx, agent.HeartbeatKey("kvm", h)); err != nil {
				lost++
				if lost <= 5 {
					t.Errorf("round %d: the record of kvm.%s: %v", i, h, err)
				}
			}
		}
	}
	if lost > 0 {
		t.Errorf("%d records of live agents lost over %d rounds", lost, rounds)
	}
}
