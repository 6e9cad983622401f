package planner

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
)

// appendAll appends evs to the log as their sources would.
func appendAll(t *testing.T, c *bus.Conn, evs []lifecycletest.Event) {
	t.Helper()
	for _, e := range evs {
		if e.Subject != "" {
			bustest.AppendOn(t, c, e.Subject, e.Source, e.Aggregate, e.ID, e.Kind, e.MsgID, e.Data)
			continue
		}
		if _, err := bus.NewEventStore(c, e.Source, nil).Append(t.Context(), e.Aggregate, e.ID, e.Kind, e.MsgID, e.Data, nil); err != nil {
			t.Fatalf("append %s %s: %v", e.ID, e.Kind, err)
		}
	}
}

// foldLog replays the whole log into a fresh state.
func foldLog(t *testing.T, c *bus.Conn, log *slog.Logger) *state {
	t.Helper()
	st := newState(log, defaultKeepFinished)
	if err := bus.NewEventStore(c, "reader", nil).Replay(t.Context(), 0, func(ev bus.Event) error {
		st.apply(ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return st
}

// The planner's fold reaches, for every proxy of the adversarial and random
// sequences, the state the lifecycle table gives it. Health's projection is
// held to the same sequences (services/health/internal/projection), so the
// two agree.
func TestFoldFollowsLifecycleTable(t *testing.T) {
	c := bustest.Start(t)
	all := lifecycletest.Adversarial("adv")
	for seed := range 40 {
		all = append(all, lifecycletest.Sequence(fmt.Sprintf("s%d", seed), uint64(seed), 40)...)
	}
	appendAll(t, c, all)
	st := foldLog(t, c, testLogger())
	want := lifecycletest.Want(all)
	for _, id := range lifecycletest.IDs(all) {
		got := ""
		if x := st.proxies[id]; x != nil {
			got = x.State
		}
		if got != want[id] {
			t.Errorf("proxy %s: state %q; want %q", id, got, want[id])
		}
	}
}

// A late create is recorded on a failed or retiring proxy (the delete
// needs its provider id) without reviving it.
func TestFoldRecordsLateCreateWithoutReviving(t *testing.T) {
	c := bustest.Start(t)
	appendAll(t, c, []lifecycletest.Event{
		lifecycletest.As("demo-f", events.ProxyRequested, 0),
		lifecycletest.As("demo-f", events.ProxyFailed, 1),
		lifecycletest.As("demo-f", events.ProxyProvisioning, 2),
		lifecycletest.As("demo-f", events.ProxyRunning, 3),
	})
	st := foldLog(t, c, testLogger())
	x := st.proxies["demo-f"]
	if x == nil {
		t.Fatal("demo-f not in state")
	}
	if x.State != events.ProxyFailed || x.ProviderID != "pid-2" || x.Address != "127.0.0.1:20003" || x.Reason != "failure 1" {
		t.Errorf("demo-f = state %q, provider id %q, address %q, reason %q; want failed, pid-2, 127.0.0.1:20003, failure 1",
			x.State, x.ProviderID, x.Address, x.Reason)
	}
	if got := st.pools["demo"].counts; len(got) != 1 || got[events.ProxyFailed] != 1 {
		t.Errorf("pool counts %v; want map[failed:1]", got)
	}
}

// Events with an id that breaks the identifier rule, or from a writer not
// allowed to append their type, never enter state and are logged once per
// aggregate; a refused event still moves the proxy's last sequence, which
// the next decision is appended against.
func TestFoldRejectsBadIDsAndWrongWriters(t *testing.T) {
	c := bustest.Start(t)
	agent := events.AgentSource(lifecycletest.Entry, lifecycletest.Target)
	appendAll(t, c, []lifecycletest.Event{
		lifecycletest.As("Demo_X", events.ProxyRequested, 0),
		lifecycletest.As("Demo_X", events.ProxyRunning, 1),
		lifecycletest.As("Demo_X", events.ProxyRunning, 2),
		lifecycletest.As("demo-a", events.ProxyRequested, 3),
		lifecycletest.Make("demo-a", events.ProxyRetiring, agent, 4),
		lifecycletest.Make("demo-a", events.ProxyReady, agent, 5),
		lifecycletest.Make("demo-b", events.ProxyRequested, agent, 6),
		lifecycletest.Make("demo-b", events.ProxyRequested, agent, 7),
	})
	var buf bytes.Buffer
	st := foldLog(t, c, slog.New(slog.NewTextHandler(&buf, nil)))
	if _, ok := st.proxies["Demo_X"]; ok {
		t.Error("Demo_X entered state")
	}
	if _, ok := st.proxies["demo-b"]; ok {
		t.Error("demo-b, requested by an agent, entered state")
	}
	x := st.proxies["demo-a"]
	if x == nil || x.State != events.ProxyRequested || x.Reason != "" || x.DeleteAttempt != 0 || x.LastSeq != 6 {
		t.Errorf("demo-a = %+v; want requested, no reason, no delete attempt, last seq 6", x)
	}
	lines := strings.Count(buf.String(), "skipping events that break the event contract")
	if lines != 3 {
		t.Errorf("%d reports; want 3 (Demo_X, demo-a, demo-b once each):\n%s", lines, buf.String())
	}
}

// Only the agent a proxy was placed on speaks for it: another agent's
// running (on its own subject, or forging the placed agent's subject or
// source), failed and deleted, an agent's running on a decision's subject
// and a decision on an agent's subject change neither the proxy's state
// nor its address, and are reported once per aggregate and problem; the
// proxy's last sequence still moves on (the next decision expects it), and
// the placed agent's next running still applies.
func TestFoldRefusesForgedObservations(t *testing.T) {
	c := bustest.Start(t)
	const id = "demo-forged"
	placed := events.AgentSource(lifecycletest.Entry, lifecycletest.Target)
	other := events.AgentSource(lifecycletest.Entry, lifecycletest.OtherTarget)
	placedSubject := func(kind string) string {
		return events.ObservationSubject(id, kind, lifecycletest.Entry, lifecycletest.Target)
	}
	otherSubject := func(kind string) string {
		return events.ObservationSubject(id, kind, lifecycletest.Entry, lifecycletest.OtherTarget)
	}
	running := func(address string) events.ProxyRunningData {
		return events.ProxyRunningData{Address: address, Attempt: 1}
	}
	appendAll(t, c, []lifecycletest.Event{
		lifecycletest.As(id, events.ProxyRequested, 0),
		lifecycletest.As(id, events.ProxyProvisioning, 1),
		{Aggregate: events.AggregateProxy, ID: id, Kind: events.ProxyRunning, Source: placed, MsgID: id + ".running.2", Data: running("127.0.0.1:1001")},
	})
	forged := []struct {
		subject, source, kind string
		data                  any
	}{
		{otherSubject(events.ProxyRunning), other, events.ProxyRunning, running("127.0.0.1:6666")},
		{placedSubject(events.ProxyRunning), other, events.ProxyRunning, running("127.0.0.1:6667")},
		{otherSubject(events.ProxyRunning), placed, events.ProxyRunning, running("127.0.0.1:6668")},
		{events.EventSubject(events.AggregateProxy, id, events.ProxyRunning), placed, events.ProxyRunning, running("127.0.0.1:6669")},
		{otherSubject(events.ProxyFailed), other, events.ProxyFailed, events.ProxyFailedData{Class: events.ClassQuota, Reason: "forged"}},
		{otherSubject(events.ProxyDeleted), other, events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1}},
		{placedSubject(events.ProxyRetiring), events.SourcePlanner, events.ProxyRetiring, events.ProxyRetiringData{Reason: "forged"}},
	}
	var lastForged uint64
	for i, f := range forged {
		lastForged = bustest.AppendOn(t, c, f.subject, f.source, events.AggregateProxy, id, f.kind, fmt.Sprintf("%s.forged.%d", id, i), f.data)
	}
	var buf bytes.Buffer
	st := foldLog(t, c, slog.New(slog.NewTextHandler(&buf, nil)))
	x := st.proxies[id]
	if x == nil || x.State != events.ProxyRunning || x.Address != "127.0.0.1:1001" || x.Reason != "" || x.Entry != lifecycletest.Entry || x.Target != lifecycletest.Target || x.LastSeq != lastForged {
		t.Fatalf("after forged observations: %+v; want running at 127.0.0.1:1001 on local/t1, no reason, last seq %d", x, lastForged)
	}
	if _, avoided := st.avoid[lifecycletest.Entry+"."+lifecycletest.Target]; avoided {
		t.Error("a forged quota failure made the planner avoid the target")
	}
	if lines := strings.Count(buf.String(), "skipping events that break the event contract"); lines != 2 {
		t.Errorf("%d reports; want 2 (the subject and the source of %s, once each):\n%s", lines, id, buf.String())
	}

	appendAll(t, c, []lifecycletest.Event{
		{Aggregate: events.AggregateProxy, ID: id, Kind: events.ProxyRunning, Source: placed, MsgID: id + ".running.20", Data: running("127.0.0.1:1002")},
	})
	if x := foldLog(t, c, testLogger()).proxies[id]; x == nil || x.State != events.ProxyRunning || x.Address != "127.0.0.1:1002" {
		t.Fatalf("after the placed agent's second running: %+v; want running at 127.0.0.1:1002", x)
	}
}
