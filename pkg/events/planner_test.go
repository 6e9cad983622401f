package events

import (
	"testing"
	"time"
)

func TestPlannerSubjects(t *testing.T) {
	if got, want := PlannerTermSubject(), "fleet.evt.planner.leader.term"; got != want {
		t.Errorf("PlannerTermSubject() = %q, want %q", got, want)
	}
	if got, want := PlannerFenceSubject(), "fleet.evt.planner.leader.fence"; got != want {
		t.Errorf("PlannerFenceSubject() = %q, want %q", got, want)
	}
	for _, s := range []string{PlannerTermSubject(), PlannerFenceSubject()} {
		if agg, _, _, by, ok := ParseEventSubject(s); !ok || agg != AggregatePlanner || !by.IsZero() {
			t.Errorf("ParseEventSubject(%q) = %q, %v; want aggregate %q", s, agg, ok, AggregatePlanner)
		}
	}
}

func TestLeaderAttributesRoundTrip(t *testing.T) {
	env, err := NewEnvelope("x.requested.1", "proxyfleet/planner", EnvelopeType(AggregateProxy, ProxyRequested), "x", time.Now(), map[string]string{})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := env.Leader(); ok {
		t.Fatal("an envelope without leader attributes reports a leader")
	}
	env.SetLeader(7, "planner-a")
	raw, err := env.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	back, err := DecodeEnvelope(raw)
	if err != nil {
		t.Fatal(err)
	}
	term, leader, ok := back.Leader()
	if !ok || term != 7 || leader != "planner-a" {
		t.Fatalf("Leader() = (%d, %q, %v), want (7, \"planner-a\", true); envelope %s", term, leader, ok, raw)
	}
}
