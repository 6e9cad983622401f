package e2e_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// TestAbandonedInstanceIsDeletedThroughTheAPI: a proxy deleted with
// skipCleanup leaves its process running; instance.delete for its instance
// stops the process and removes its state (the agent records deleted),
// while instance.delete for a live proxy's instance is refused and that
// proxy keeps serving.
func TestAbandonedInstanceIsDeletedThroughTheAPI(t *testing.T) {
	org := origin(t)
	f := startFleet(t, org)

	f.apply(events.PoolSpec{Name: "keep", Provider: "local", Size: 1})
	first := f.waitPool("keep", 1, "ready", 60*time.Second)[0]
	pids := f.proxyProcs()
	if len(pids) != 1 {
		t.Fatalf("%d proxy processes run, want 1", len(pids))
	}
	abandonedPID := pids[0]

	x := must(t, "proxy.delete", func(ctx context.Context) (events.ProxyView, error) {
		return f.api.ProxyDelete(ctx, api.ProxyDeleteRequest{ID: first.ID, SkipCleanup: true})
	})
	if x.State != "abandoned" {
		t.Fatalf("skip-cleanup delete: state %q, want abandoned", x.State)
	}
	// The view folds the abandonment after the reply: until then it still
	// shows the first proxy ready, so wait for its replacement by id.
	var second proxyView
	waitFor(t, 60*time.Second, "a ready replacement of "+first.ID, func() bool {
		got := f.proxies("keep")
		if len(got) != 1 || got[0].ID == first.ID || got[0].State != "ready" {
			return false
		}
		second = got[0]
		return true
	})
	waitFor(t, 30*time.Second, "the abandoned process beside the replacement", func() bool {
		return len(f.proxyProcs()) == 2
	})
	if !slices.Contains(f.proxyProcs(), abandonedPID) {
		t.Fatalf("the abandoned proxy's process %d stopped; skipCleanup must leave it", abandonedPID)
	}
	name := events.InstanceName(first.ID)
	if _, err := os.Stat(filepath.Join(f.stateDir, name+".json")); err != nil {
		t.Fatalf("state of the abandoned instance: %v", err)
	}

	// A live proxy's instance is refused, and nothing happens to it.
	before := f.intentEvents()
	if before == 0 {
		t.Fatal("no proxy or pool events counted: the filters match nothing")
	}
	_, err := f.api.InstanceDelete(context.Background(), api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: events.InstanceName(second.ID)})
	if aerr, ok := errors.AsType[*api.APIError](err); !ok || aerr.Status != "422" {
		t.Fatalf("instance.delete of a live proxy's instance: got %v, want a 422", err)
	}
	if after := f.intentEvents(); after != before {
		t.Errorf("refused instance.delete appended events: %d -> %d", before, after)
	}

	rep := must(t, "instance.delete", func(ctx context.Context) (api.InstanceDeleteReply, error) {
		return f.api.InstanceDelete(ctx, api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: name})
	})
	if rep.ProxyID != first.ID || rep.Previous != "abandoned" {
		t.Fatalf("instance.delete reply: got %+v, want proxy %s previously abandoned", rep, first.ID)
	}
	waitFor(t, 30*time.Second, "the abandoned proxy's deleted event", func() bool {
		return f.eventCount(events.ObservationFilter(first.ID, events.ProxyDeleted)) == 1
	})
	waitFor(t, 10*time.Second, "the abandoned process to exit", func() bool {
		return !slices.Contains(f.proxyProcs(), abandonedPID)
	})
	if _, err := os.Stat(filepath.Join(f.stateDir, name+".json")); !os.IsNotExist(err) {
		t.Errorf("state of the deleted instance: got %v, want it removed", err)
	}
	if _, err := os.Stat(filepath.Join(f.stateDir, name)); !os.IsNotExist(err) {
		t.Errorf("files of the deleted instance: got %v, want them removed", err)
	}
	if got := f.proxyProcs(); len(got) != 1 {
		t.Errorf("proxy processes: got %v, want only the replacement's", got)
	}
	if code, _, err := getThrough(second.Address, org.URL, nil); err != nil || code != 200 {
		t.Errorf("the live proxy stopped working: %d %v", code, err)
	}
	// The proxy stays out of the views, and the instance, gone, cannot be
	// deleted again.
	if _, ok := f.views("fleet-proxies")[first.ID]; ok {
		t.Errorf("the deleted instance's proxy came back into fleet-proxies")
	}
	_, err = f.api.InstanceDelete(context.Background(), api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: name})
	if aerr, ok := errors.AsType[*api.APIError](err); !ok || aerr.Status != "422" || aerr.Message == "" {
		t.Errorf("instance.delete of a deleted instance: got %#v, want a 422 with a message", err)
	}
}
