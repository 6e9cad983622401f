package tail

import (
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

func event(t *testing.T, seq uint64, aggregate, id, kind string, by events.Observer, data any) bus.Event {
	t.Helper()
	env, err := events.NewEnvelope(id+"."+kind, "test", events.EnvelopeType(aggregate, kind), id, time.Unix(int64(seq), 0), data)
	if err != nil {
		t.Fatal(err)
	}
	return bus.Event{Envelope: env, Seq: seq, Aggregate: aggregate, ID: id, Kind: kind, By: by}
}

func TestTailSaysWhyAndFilters(t *testing.T) {
	tl := New(100, func(id string) string {
		if id == "old-1" {
			return "old" // requested before the tail began: the views know it
		}
		return ""
	})
	agent := events.Observer{Entry: "local", Target: "t1"}
	for _, ev := range []bus.Event{
		event(t, 1, events.AggregatePool, "demo", events.PoolApplied, events.Observer{}, events.PoolAppliedData{Spec: events.PoolSpec{Name: "demo", Size: 3}, Revision: 1}),
		event(t, 2, events.AggregateProxy, "demo-a", events.ProxyRequested, events.Observer{}, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1"}}),
		event(t, 3, events.AggregateProxy, "demo-a", events.ProxyRunning, agent, events.ProxyRunningData{Address: "127.0.0.1:20000"}),
		event(t, 4, events.AggregateProxy, "demo-b", events.ProxyRequested, events.Observer{}, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1"}, Replaces: "demo-a", ReplaceReason: "recycled by operator"}),
		event(t, 5, events.AggregateProxy, "demo-a", events.ProxyRetiring, events.Observer{}, events.ProxyRetiringData{Reason: "replaced by demo-b: recycled by operator"}),
		event(t, 6, events.AggregatePool, "demo", events.PoolCondition, events.Observer{}, events.PoolConditionData{Type: "Placed", Status: "False", Reason: "NoTargetOffersImage", Message: "no target offers debian-13"}),
		event(t, 7, events.AggregatePool, "demo", events.PoolScaled, events.Observer{}, events.PoolScaledData{Size: 5, Previous: 3, Reason: "autoscale: 37 connections for 3 proxies"}),
		event(t, 8, events.AggregateProxy, "old-1", events.ProxyFailed, agent, events.ProxyFailedData{Class: "quota", Reason: "out of addresses"}),
		event(t, 9, events.AggregatePlanner, "leader", events.PlannerTerm, events.Observer{}, events.PlannerTermData{Term: 1}),
	} {
		tl.Add(ev)
	}
	all := tl.Last(100, "", "")
	if len(all) != 8 || all[0].Seq != 8 {
		t.Fatalf("%d entries, newest seq %d; want 8 (the planner's term left out), newest first", len(all), all[0].Seq)
	}
	want := map[uint64]string{
		1: "applied: revision 1, size 3",
		2: "requested on local/t1",
		3: "running at 127.0.0.1:20000 (local/t1)",
		4: "replaced because recycled by operator: demo-b requested on local/t1 to replace demo-a",
		5: "retiring because replaced by demo-b: recycled by operator",
		6: "Placed=False NoTargetOffersImage: no target offers debian-13",
		7: "scaled to 5 from 3: autoscale: 37 connections for 3 proxies",
		8: "failed (quota) (local/t1): out of addresses",
	}
	for _, e := range all {
		if e.Text != want[e.Seq] {
			t.Errorf("seq %d: %q, want %q", e.Seq, e.Text, want[e.Seq])
		}
	}
	rep := tl.Last(100, "", "demo-a")
	if len(rep) != 4 || rep[1].Type != "replaced" || rep[1].Proxy != "demo-a" || rep[1].Replacement != "demo-b" {
		t.Fatalf("proxy demo-a's entries: %+v", rep)
	}
	if got := tl.Last(100, "", "demo-b"); len(got) != 1 || got[0].Type != "replaced" {
		t.Fatalf("the replacement's entries: %+v", got)
	}
	if got := tl.Last(100, "old", ""); len(got) != 1 || !strings.HasPrefix(got[0].Text, "failed") {
		t.Fatalf("pool old (named by the views): %+v", got)
	}
	if got := tl.Last(2, "demo", ""); len(got) != 2 || got[0].Seq != 7 {
		t.Fatalf("the last 2 of demo: %+v", got)
	}
}

func TestTailIsBounded(t *testing.T) {
	tl := New(100, nil)
	for i := range 1000 {
		tl.Add(event(t, uint64(i+1), events.AggregatePool, "demo", events.PoolDeleted, events.Observer{}, events.PoolDeletedData{Revision: i + 1}))
	}
	all := tl.Last(1000, "", "")
	if len(all) != 100 || all[0].Seq != 1000 || all[99].Seq != 901 {
		t.Fatalf("%d entries from %d to %d; want the last 100", len(all), all[len(all)-1].Seq, all[0].Seq)
	}
}
