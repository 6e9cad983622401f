package events_test

import (
	"reflect"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestSetCondition(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1, t2, t3 := t0.Add(time.Second), t0.Add(2*time.Second), t0.Add(3*time.Second)
	var list []events.Condition
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionFalse, Reason: events.ReasonNoLiveTarget, Message: "a"}, t0)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionFalse, Reason: events.ReasonNoLiveTarget, Message: "b"}, t1)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionProgressing, Status: events.ConditionTrue, Reason: events.ReasonScaling}, t1)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced}, t2)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionFalse, Reason: events.ReasonNotEnoughReady, Message: "r"}, t3)
	want := []events.Condition{
		{Type: events.ConditionReady, Status: events.ConditionFalse, Reason: events.ReasonNotEnoughReady, Message: "r", Since: t3},
		{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced, Since: t2},
		{Type: events.ConditionProgressing, Status: events.ConditionTrue, Reason: events.ReasonScaling, Since: t1},
	}
	if !reflect.DeepEqual(list, want) {
		t.Fatalf("got  %+v\nwant %+v", list, want)
	}
	// A message change keeps since; the input list is not modified.
	before := append([]events.Condition(nil), list...)
	next := events.SetCondition(list, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionFalse, Reason: events.ReasonNotEnoughReady, Message: "s"}, t3.Add(time.Hour))
	if c, _ := events.FindCondition(next, events.ConditionReady); c.Message != "s" || !c.Since.Equal(t3) {
		t.Errorf("message change: got %+v, want message s since %v", c, t3)
	}
	if !reflect.DeepEqual(list, before) {
		t.Errorf("SetCondition modified its input")
	}
	bad := events.PoolConditionData{Type: "Healthy", Status: "yes"}
	if err := bad.Validate(); err == nil {
		t.Error("invalid condition data accepted")
	}
}

// TestCleanupCondition: a Cleanup condition validates and folds after the
// other three, whatever the order of its events.
func TestCleanupCondition(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	stuck := events.PoolConditionData{Type: events.ConditionCleanup, Status: events.ConditionFalse, Reason: events.ReasonDeleteStuck, Message: "px-a"}
	if err := stuck.Validate(); err != nil {
		t.Fatalf("Cleanup condition refused: %v", err)
	}
	var list []events.Condition
	list = events.SetCondition(list, stuck, t0)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionProgressing, Status: events.ConditionFalse, Reason: events.ReasonSettled}, t0)
	list = events.SetCondition(list, events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionUnknown, Reason: events.ReasonHealthUnavailable}, t0)
	var got []string
	for _, c := range list {
		got = append(got, c.Type)
	}
	if want := []string{events.ConditionReady, events.ConditionProgressing, events.ConditionCleanup}; !reflect.DeepEqual(got, want) {
		t.Fatalf("order: got %v, want %v", got, want)
	}
}
