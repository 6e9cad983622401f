//go:build integration

package kube

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// TestKubeDeadPodsFailTheirProxies runs the agent runtime with its default
// recheck interval against the real API server: a running proxy's Pod that
// ends (phase Failed, as the kubelet reports an exited container) and one
// that is deleted behind the agent's back each get failed (class
// terminated). It logs the detection delay of each.
func TestKubeDeadPodsFailTheirProxies(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("dead")
	// An entry of its own: TestKubeClusterScopeOverlay lists the marked
	// Pods of its entry cluster-wide.
	const entry = "k8s-dead"
	d := &countingDriver{Driver: e.driver(entry, ns)}
	conn := bustest.Start(t)
	rt, err := agent.New(bustest.Dial(t, conn), d, agent.Config{
		Info:          agent.Info{Entry: entry, Target: ns, Type: "kubernetes"},
		WatchInterval: 50 * time.Millisecond,
		// Heartbeats list too: keep them out of the count of rechecks.
		HeartbeatInterval: time.Hour,
	}, nil, nil)
	must(t, err)
	agenttest.Serve(t, rt.Run)

	store := bus.NewEventStore(conn, "test", nil)
	ids := []string{"pool-k-ends", "pool-k-gone"}
	t.Cleanup(func() {
		for _, id := range ids {
			_ = d.Delete(context.Background(), agent.Ref{ProxyID: id, Name: events.InstanceName(id), ProviderID: ProviderID(ns, events.InstanceName(id))})
		}
	})
	for i, id := range ids {
		cmd := events.CreateCommand{ProxyID: id, ProxySpec: events.ProxySpec{Pool: "pool-k", Entry: entry, Target: ns, Instance: events.InstanceName(id), Port: 3128}, Attempt: 1}
		_, err := bus.PublishCreate(context.Background(), conn, "test", cmd, 0)
		must(t, err)
		name := events.InstanceName(id)
		bustest.WaitEvent(t, 60*time.Second, store, id, events.ProxyProvisioning)
		e.setStatus(ns, name, corev1.PodRunning, "10.244.3."+string(rune('1'+i)))
		bustest.WaitEvent(t, 60*time.Second, store, id, events.ProxyRunning)
	}
	// A recheck lists both Pods running before they die, as in a fleet
	// where they served for a while.
	listed := d.lists.Load()
	must(t, poll(3*agent.DefaultRecheckInterval, func() error {
		if d.lists.Load() <= listed {
			return errNotYet
		}
		return nil
	}))

	killed := time.Now()
	e.setStatus(ns, events.InstanceName(ids[0]), corev1.PodFailed, "")
	zero := int64(0)
	must(t, e.admin.CoreV1().Pods(ns).Delete(context.Background(), events.InstanceName(ids[1]), metav1.DeleteOptions{GracePeriodSeconds: &zero}))
	for i, want := range []string{"terminated: Pod phase Failed", "disappeared"} {
		id := ids[i]
		var at time.Time
		must(t, poll(3*agent.DefaultRecheckInterval, func() error {
			evs, err := store.Load(context.Background(), events.AggregateProxy, id)
			if err != nil {
				return err
			}
			last := evs[len(evs)-1]
			if last.Kind != events.ProxyFailed {
				return errNotYet
			}
			var f events.ProxyFailedData
			must(t, last.DecodeData(&f))
			if f.Class != events.ClassTerminated || !strings.Contains(f.Reason, want) {
				t.Fatalf("proxy %s failed with %+v, want class terminated and %q", id, f, want)
			}
			at = last.Time
			return nil
		}))
		t.Logf("proxy %s: failed (%s) %.1fs after its Pod died (recheck interval %s)", id, want, at.Sub(killed).Seconds(), agent.DefaultRecheckInterval)
	}
}

var errNotYet = errors.New("not yet")

// countingDriver counts List calls.
type countingDriver struct {
	*Driver
	lists atomic.Int64
}

func (c *countingDriver) List(ctx context.Context) ([]agent.Instance, error) {
	defer c.lists.Add(1)
	return c.Driver.List(ctx)
}
