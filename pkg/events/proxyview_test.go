package events_test

import (
	"reflect"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// apply folds one event of kind with data at time at into v, as a reader
// does after events.Transition.
func apply(t *testing.T, v *events.ProxyView, seq uint64, kind, envID string, at time.Time, data any) {
	t.Helper()
	to, ok := events.Transition(v.State, kind)
	if !ok {
		t.Fatalf("%s on %s: transition refused", kind, v.State)
	}
	env, err := events.NewEnvelope(envID, "test", events.EnvelopeType(events.AggregateProxy, kind), v.ID, at, data)
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Apply(to, seq, kind, env); err != nil {
		t.Fatal(err)
	}
}

func TestProxyViewApply(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	const id = "demo-aaaaaaaaaa"
	v := events.NewProxyView(id, id+".requested.1", 1, t0, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: "px-a", Revision: 1, Port: 3128}})
	if v.State != events.ProxyRequested || v.Attempt != 1 || !v.CreatedAt.Equal(t0) {
		t.Fatalf("new view: %+v", v)
	}
	// A re-issued create moves the attempt, not the creation time.
	apply(t, &v, 2, events.ProxyRequested, id+".requested.2.ab12", at(1), events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: "px-a"}})
	if v.Attempt != 2 || !v.CreatedAt.Equal(t0) || !v.UpdatedAt.Equal(at(1)) || v.Seq != 2 {
		t.Errorf("re-issued create: %+v", v)
	}
	apply(t, &v, 3, events.ProxyProvisioning, id+".provisioning.2", at(2), events.ProxyProvisioningData{ProviderID: "pid", Attempt: 2})
	apply(t, &v, 4, events.ProxyRunning, id+".running.2", at(3), events.ProxyRunningData{Address: "127.0.0.1:1", Attempt: 2})
	apply(t, &v, 5, events.ProxyReady, id+".ready.5", at(4), events.ProxyReadyData{LatencyMS: 7, EgressIP: "192.0.2.1"})
	if v.State != events.ProxyReady || v.Address != "127.0.0.1:1" || v.ProviderID != "pid" || v.LatencyMS != 7 {
		t.Errorf("ready: %+v", v)
	}
	// Unhealthy since the first unhealthy event, cleared by ready.
	apply(t, &v, 6, events.ProxyUnhealthy, id+".unhealthy.6", at(5), events.ProxyUnhealthyData{Reason: "refused", Streak: 3})
	apply(t, &v, 7, events.ProxyUnhealthy, id+".unhealthy.7", at(9), events.ProxyUnhealthyData{Reason: "timeout", Streak: 5})
	if !v.UnhealthySince.Equal(at(5)) || v.Reason != "timeout" || v.Streak != 5 {
		t.Errorf("unhealthy: since %v reason %q streak %d, want since %v, timeout, 5", v.UnhealthySince, v.Reason, v.Streak, at(5))
	}
	apply(t, &v, 8, events.ProxyReady, id+".ready.8", at(10), events.ProxyReadyData{LatencyMS: 9})
	if !v.UnhealthySince.IsZero() || v.Reason != "" || v.Streak != 0 {
		t.Errorf("ready again: %+v", v)
	}
	// Failed, then a late running: recorded, state and reason kept.
	apply(t, &v, 9, events.ProxyFailed, id+".failed.9", at(11), events.ProxyFailedData{Class: events.ClassTerminated, Reason: "gone"})
	apply(t, &v, 10, events.ProxyRunning, id+".running.3", at(12), events.ProxyRunningData{Address: "127.0.0.1:2"})
	if v.State != events.ProxyFailed || v.Reason != "gone" || v.FailureClass != events.ClassTerminated || v.Address != "127.0.0.1:2" {
		t.Errorf("late running on failed: %+v", v)
	}
	// Skip-cleanup survives a re-issued retiring.
	apply(t, &v, 11, events.ProxyRetiring, id+".retiring.11", at(13), events.ProxyRetiringData{Reason: "deleted", SkipCleanup: true})
	apply(t, &v, 12, events.ProxyRetiring, id+".retiring.12", at(14), events.ProxyRetiringData{Reason: "deleted"})
	if !v.SkipCleanup || v.State != events.ProxyRetiring {
		t.Errorf("re-issued retiring: %+v", v)
	}
	// Data that does not decode changes nothing.
	before := v
	bad, _ := events.NewEnvelope(id+".retiring.13", "test", events.EnvelopeType(events.AggregateProxy, events.ProxyRetiring), id, at(15), []int{1})
	if err := v.Apply(events.ProxyRetiring, 13, events.ProxyRetiring, bad); err == nil || !reflect.DeepEqual(v, before) {
		t.Errorf("undecodable data: err %v, view %+v", err, v)
	}
}
