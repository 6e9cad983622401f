package projection_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/events/lifecycletest"
	"proxyfleet/services/health/internal/projection"
)

// appendAll appends evs to the log as their sources would.
func (e *env) appendAll(evs []lifecycletest.Event) {
	e.t.Helper()
	for _, ev := range evs {
		if ev.Subject != "" {
			bustest.AppendOn(e.t, e.conn, ev.Subject, ev.Source, ev.Aggregate, ev.ID, ev.Kind, ev.MsgID, ev.Data)
			continue
		}
		if _, err := bus.NewEventStore(e.conn, ev.Source, nil).Append(e.ctx, ev.Aggregate, ev.ID, ev.Kind, ev.MsgID, ev.Data, nil); err != nil {
			e.t.Fatalf("append %s %s: %v", ev.ID, ev.Kind, err)
		}
	}
}

// The projection reaches, for every proxy of the adversarial and random
// sequences, the state the lifecycle table gives it: the planner's fold is
// held to the same sequences (services/planner/internal/planner), so the
// two agree. Deleted and abandoned proxies have no key.
func TestProjectionFollowsLifecycleTable(t *testing.T) {
	e := start(t)
	all := lifecycletest.Adversarial("adv")
	for seed := range 40 {
		all = append(all, lifecycletest.Sequence(fmt.Sprintf("s%d", seed), uint64(seed), 40)...)
	}
	e.appendAll(all)
	e.caughtUp()
	want := lifecycletest.Want(all)
	for _, id := range lifecycletest.IDs(all) {
		w := want[id]
		if events.IsTerminal(w) {
			w = ""
		}
		got := ""
		if v, ok := e.proxy(id); ok {
			got = v.State
		}
		if got != w {
			t.Errorf("proxy %s: view state %q; want %q (the table's %q)", id, got, w, want[id])
		}
	}
}

// A create finishing after the proxy failed is recorded (provider id,
// address) but the proxy stays failed, with its class and reason.
func TestLateCreateOnFailedProxyIsRecorded(t *testing.T) {
	e := start(t)
	e.appendAll([]lifecycletest.Event{
		lifecycletest.As("demo-f", events.ProxyRequested, 0),
		lifecycletest.As("demo-f", events.ProxyFailed, 1),
		lifecycletest.As("demo-f", events.ProxyProvisioning, 2),
		lifecycletest.As("demo-f", events.ProxyRunning, 3),
	})
	e.caughtUp()
	got, ok := e.proxy("demo-f")
	if !ok {
		t.Fatal("demo-f has no key")
	}
	if got.State != events.ProxyFailed || got.FailureClass != events.ClassPermanent || got.Reason != "failure 1" ||
		got.ProviderID != "pid-2" || got.Address != "127.0.0.1:20003" || got.Attempt != 1 || got.Seq != 4 {
		t.Errorf("demo-f = %+v; want failed, permanent, failure 1, pid-2, 127.0.0.1:20003, attempt 1 (of the running), seq 4", got)
	}
	if got.Probeable() {
		t.Error("a failed proxy must not be probed")
	}
}

// A failure reported after the planner decided to retire the proxy leaves
// it retiring, with the retire reason.
func TestFailureOnRetiringProxyIsIgnored(t *testing.T) {
	e := start(t)
	e.appendAll([]lifecycletest.Event{
		lifecycletest.As("demo-r", events.ProxyRequested, 0),
		lifecycletest.As("demo-r", events.ProxyRetiring, 1),
		lifecycletest.As("demo-r", events.ProxyFailed, 2),
	})
	e.caughtUp()
	got, _ := e.proxy("demo-r")
	if got.State != events.ProxyRetiring || got.Reason != "retire 1" || got.FailureClass != "" || got.Seq != 2 {
		t.Errorf("demo-r = %+v; want retiring, retire 1, no failure class, seq 2", got)
	}
}

// Events with an id that breaks the identifier rule, or from a writer not
// allowed to append their type, never reach the views and are logged once
// per aggregate.
func TestRejectedEventsNeverEnterTheViews(t *testing.T) {
	e := start(t)
	agent := events.AgentSource(lifecycletest.Entry, lifecycletest.Target)
	e.appendAll([]lifecycletest.Event{
		lifecycletest.As("Demo_X", events.ProxyRequested, 0),
		lifecycletest.As("Demo_X", events.ProxyRunning, 1),
		lifecycletest.As("demo-a", events.ProxyRequested, 2),
		lifecycletest.Make("demo-a", events.ProxyReady, agent, 3),
		lifecycletest.Make("demo-a", events.ProxyRetiring, agent, 4),
		lifecycletest.Make("demo-b", events.ProxyRequested, events.SourceHealth, 5),
		lifecycletest.Make("demo-b", events.ProxyRequested, events.SourceHealth, 6),
	})
	e.appendPoolAs("Demo_Pool", events.SourcePlanner)
	e.appendPoolAs("demo", agent)
	e.caughtUp()
	var buf bytes.Buffer
	if err := projection.Replay(e.ctx, e.conn, slog.New(slog.NewTextHandler(&buf, nil))); err != nil {
		t.Fatal(err)
	}
	d := e.dump()
	if len(d) != 1 {
		t.Fatalf("views hold %v; want only proxy demo-a", keysOf(d))
	}
	if got, _ := e.proxy("demo-a"); got.State != events.ProxyRequested || got.Seq != 3 {
		t.Errorf("demo-a = %+v; want requested at seq 3", got)
	}
	if got := strings.Count(buf.String(), "skipping events that break the event contract"); got != 5 {
		t.Errorf("%d reports; want 5 (Demo_X, demo-a, demo-b, Demo_Pool, demo once each):\n%s", got, buf.String())
	}
}

func (e *env) appendPoolAs(name, source string) {
	e.t.Helper()
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Port: 3128}
	if _, err := bus.NewEventStore(e.conn, source, nil).Append(e.ctx, events.AggregatePool, name, events.PoolApplied,
		name+".applied.1", events.PoolAppliedData{Spec: spec, Revision: 1}, nil); err != nil {
		e.t.Fatal(err)
	}
}

// Only the agent a proxy was placed on speaks for it. Another agent's
// running (on its own subject, or forging the placed agent's subject or
// source), failed and deleted, an agent's running on a decision's subject
// and a decision on an agent's subject change neither the proxy's state
// nor its address in the view; the placed agent's observations still do.
func TestForgedObservationsMoveNothing(t *testing.T) {
	e := start(t)
	const id = "demo-forged"
	placed := events.AgentSource(lifecycletest.Entry, lifecycletest.Target)
	other := events.AgentSource(lifecycletest.Entry, lifecycletest.OtherTarget)
	e.appendAll([]lifecycletest.Event{
		lifecycletest.As(id, events.ProxyRequested, 0),
		lifecycletest.As(id, events.ProxyProvisioning, 1),
	})
	legit := e.appendRunning(id, placed, "", "127.0.0.1:1001", 2)
	if v := e.waitProxy(id, legit); v.State != events.ProxyRunning || v.Address != "127.0.0.1:1001" {
		t.Fatalf("after the placed agent's running: state %q address %q; want running at 127.0.0.1:1001", v.State, v.Address)
	}
	observe := func(kind string) string {
		return events.ObservationSubject(id, kind, lifecycletest.Entry, lifecycletest.OtherTarget)
	}
	e.appendRunning(id, other, "", "127.0.0.1:6666", 3)
	e.appendRunning(id, other, events.ObservationSubject(id, events.ProxyRunning, lifecycletest.Entry, lifecycletest.Target), "127.0.0.1:6667", 4)
	e.appendRunning(id, placed, observe(events.ProxyRunning), "127.0.0.1:6668", 5)
	e.appendRunning(id, placed, events.EventSubject(events.AggregateProxy, id, events.ProxyRunning), "127.0.0.1:6669", 6)
	bustest.AppendOn(t, e.conn, observe(events.ProxyFailed), other, events.AggregateProxy, id, events.ProxyFailed, id+".failed.7", events.ProxyFailedData{Class: events.ClassPermanent, Reason: "forged"})
	bustest.AppendOn(t, e.conn, observe(events.ProxyDeleted), other, events.AggregateProxy, id, events.ProxyDeleted, id+".deleted.8", events.ProxyDeletedData{Attempt: 1})
	bustest.AppendOn(t, e.conn, events.ObservationSubject(id, events.ProxyRetiring, lifecycletest.Entry, lifecycletest.Target), events.SourcePlanner,
		events.AggregateProxy, id, events.ProxyRetiring, id+".retiring.9", events.ProxyRetiringData{Reason: "forged"})
	e.caughtUp()
	if v, ok := e.proxy(id); !ok || v.State != events.ProxyRunning || v.Address != "127.0.0.1:1001" || v.Seq != legit || v.Reason != "" {
		t.Fatalf("after forged observations: %+v (found %v); want running at 127.0.0.1:1001, seq %d, no reason", v, ok, legit)
	}
	again := e.appendRunning(id, placed, "", "127.0.0.1:1002", 10)
	if v := e.waitProxy(id, again); v.State != events.ProxyRunning || v.Address != "127.0.0.1:1002" {
		t.Fatalf("after the placed agent's second running: state %q address %q; want running at 127.0.0.1:1002", v.State, v.Address)
	}
}

// appendRunning appends a running event of id at address from source: on
// subject, or on the one source writes on when subject is "".
func (e *env) appendRunning(id, source, subject, address string, n uint64) uint64 {
	e.t.Helper()
	data := events.ProxyRunningData{Address: address, Attempt: 1}
	msgID := events.ProxyEventID(id, events.ProxyRunning, n)
	if subject != "" {
		return bustest.AppendOn(e.t, e.conn, subject, source, events.AggregateProxy, id, events.ProxyRunning, msgID, data)
	}
	seq, err := bus.NewEventStore(e.conn, source, nil).Append(e.ctx, events.AggregateProxy, id, events.ProxyRunning, msgID, data, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return seq
}
