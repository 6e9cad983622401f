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
