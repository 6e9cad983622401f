package planner

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/events/lifecycletest"
)

// eventLog is a log of events as FLEET_EVENTS would store them, without a
// server: each event is encoded as its source would append it, sequenced
// in order, and an event repeating an earlier Msg-Id is dropped as the
// stream's deduplication drops it.
type eventLog struct {
	evs  []bus.Event
	seq  uint64
	seen map[string]bool
}

// append adds evs to the log and returns the sequence of the last one.
func (l *eventLog) append(t *testing.T, evs ...lifecycletest.Event) uint64 {
	t.Helper()
	if l.seen == nil {
		l.seen = map[string]bool{}
	}
	for _, e := range evs {
		if l.seen[e.MsgID] {
			continue
		}
		l.seen[e.MsgID] = true
		subject := e.On()
		env, err := events.NewEnvelope(e.MsgID, e.Source, events.EnvelopeType(e.Aggregate, e.Kind), e.ID, time.Now(), e.Data)
		if err != nil {
			t.Fatalf("append %s %s: %v", e.ID, e.Kind, err)
		}
		body, err := env.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		l.seq++
		agg, id, kind, by, ok := events.ParseEventSubject(subject)
		if !ok {
			continue // a reader skips it
		}
		if env, err = events.DecodeEnvelope(body); err != nil {
			continue // a reader skips it
		}
		l.evs = append(l.evs, bus.Event{Envelope: env, Seq: l.seq, Aggregate: agg, ID: id, Kind: kind, By: by, Header: nats.Header{}})
	}
	return l.seq
}

// fold replays the whole log into a fresh state.
func (l *eventLog) fold(log *slog.Logger) *state {
	st := newState(log, defaultKeepFinished)
	for _, e := range l.evs {
		st.apply(e)
	}
	return st
}

// The planner's fold reaches, for every proxy of the adversarial and random
// sequences, the state the lifecycle table gives it. Health's projection is
// held to the same sequences (services/health/internal/projection), so the
// two agree.
func TestFoldFollowsLifecycleTable(t *testing.T) {
	var l eventLog
	all := lifecycletest.Adversarial("adv")
	for seed := range 40 {
		all = append(all, lifecycletest.Sequence(fmt.Sprintf("s%d", seed), uint64(seed), 40)...)
	}
	l.append(t, all...)
	st := l.fold(testLogger())
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
	var l eventLog
	l.append(t, []lifecycletest.Event{
		lifecycletest.As("demo-f", events.ProxyRequested, 0),
		lifecycletest.As("demo-f", events.ProxyFailed, 1),
		lifecycletest.As("demo-f", events.ProxyProvisioning, 2),
		lifecycletest.As("demo-f", events.ProxyRunning, 3),
	}...)
	st := l.fold(testLogger())
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
	var l eventLog
	agent := events.AgentSource(lifecycletest.Entry, lifecycletest.Target)
	l.append(t, []lifecycletest.Event{
		lifecycletest.As("Demo_X", events.ProxyRequested, 0),
		lifecycletest.As("Demo_X", events.ProxyRunning, 1),
		lifecycletest.As("Demo_X", events.ProxyRunning, 2),
		lifecycletest.As("demo-a", events.ProxyRequested, 3),
		lifecycletest.Make("demo-a", events.ProxyRetiring, agent, 4),
		lifecycletest.Make("demo-a", events.ProxyReady, agent, 5),
		lifecycletest.Make("demo-b", events.ProxyRequested, agent, 6),
		lifecycletest.Make("demo-b", events.ProxyRequested, agent, 7),
	}...)
	var buf bytes.Buffer
	st := l.fold(slog.New(slog.NewTextHandler(&buf, nil)))
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
	var l eventLog
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
	l.append(t, []lifecycletest.Event{
		lifecycletest.As(id, events.ProxyRequested, 0),
		lifecycletest.As(id, events.ProxyProvisioning, 1),
		{Aggregate: events.AggregateProxy, ID: id, Kind: events.ProxyRunning, Source: placed, MsgID: id + ".running.2", Data: running("127.0.0.1:1001")},
	}...)
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
		lastForged = l.append(t, lifecycletest.Event{Subject: f.subject, Source: f.source, Aggregate: events.AggregateProxy, ID: id, Kind: f.kind, MsgID: fmt.Sprintf("%s.forged.%d", id, i), Data: f.data})
	}
	var buf bytes.Buffer
	st := l.fold(slog.New(slog.NewTextHandler(&buf, nil)))
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

	l.append(t, lifecycletest.Event{Aggregate: events.AggregateProxy, ID: id, Kind: events.ProxyRunning, Source: placed, MsgID: id + ".running.20", Data: running("127.0.0.1:1002")})
	if x := l.fold(testLogger()).proxies[id]; x == nil || x.State != events.ProxyRunning || x.Address != "127.0.0.1:1002" {
		t.Fatalf("after the placed agent's second running: %+v; want running at 127.0.0.1:1002", x)
	}
}
