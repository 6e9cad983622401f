package projection_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestStalledProjectorGivesThePinUp: the consumer is pinned to projector
// a, whose pull requests go on (renewing the pin, answered by heartbeats)
// while no delivery reaches it any more (the deaf hook drops them), as a
// projector whose deliveries get lost somewhere past the server would.
// It must give the pin up so that projector b, of another replica, takes
// over and projects the event. Without that, a keeps the pin for as long
// as it runs and every delivery goes to it: the views never move.
func TestStalledProjectorGivesThePinUp(t *testing.T) {
	e := openFor(t, 50*time.Second)
	var deaf atomic.Bool
	a := projection.New(e.conn, nil, nil)
	a.SetStall(2 * time.Second)
	a.SetDeaf(deaf.Load)
	b := projection.New(bustest.Dial(t, e.conn), nil, nil)
	b.SetStall(2 * time.Second)
	run := func(name string, p *projection.Projector) {
		ctx, cancel := context.WithCancel(e.ctx)
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("projector %s: %v", name, err)
			}
		})
	}

	run("a", a)
	req := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Revision: 1, Port: 3128}, Username: "crawler"}
	req.Instance = events.InstanceName("p1")
	e.waitProxy("p1", e.append("p1", events.ProxyRequested, req))
	e.eventually("the consumer pinned to a", func() bool { return pinned(e) != "" })

	run("b", b)
	deaf.Store(true)
	req.Instance = events.InstanceName("p2")
	seq := e.append("p2", events.ProxyRequested, req)
	// Only b can apply it: a drops every delivery.
	e.waitProxy("p2", seq)
}

// pinned returns the pin of the projection consumer's priority group, ""
// if none.
func pinned(e *env) string {
	cons, err := e.conn.JS.Consumer(e.ctx, bus.EventsStream, projection.ConsumerName)
	if err != nil {
		return ""
	}
	info, err := cons.Info(e.ctx)
	if err != nil || len(info.PriorityGroups) == 0 {
		return ""
	}
	return info.PriorityGroups[0].PinnedClientID
}
