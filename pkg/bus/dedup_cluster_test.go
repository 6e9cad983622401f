package bus_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestCommandRepublishDedup is the safeguard every fault of e2e's
// TestClusterFaults relies on: a create command republished with its
// Nats-Msg-Id (the planner retrying a publish whose acknowledgement a
// failed node swallowed) is dropped by the R3 stream, also after its
// leader moved to another server; the same command republished without
// its Msg-Id is stored twice, so an agent would receive it twice.
func TestCommandRepublishDedup(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-server cluster")
	}
	ctx := context.Background()
	c := startCluster(t)
	cmd := events.CreateCommand{
		ProxyID:   "p-dedup",
		ProxySpec: events.ProxySpec{Pool: "p", Entry: "local", Target: "t1", Instance: events.InstanceName("p-dedup"), Revision: 1},
		Attempt:   1,
	}
	first, err := bus.PublishCreate(ctx, c, "planner", cmd, 0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.JS.Stream(ctx, bus.CommandsStream)
	if err != nil {
		t.Fatal(err)
	}
	leader := func() string {
		info, err := s.Info(ctx)
		if err != nil || info.Cluster == nil {
			return ""
		}
		return info.Cluster.Leader
	}
	// Move the stream's leader, as a killed node does.
	before := leader()
	if _, err := c.NC.Request("$JS.API.STREAM.LEADER.STEPDOWN."+bus.CommandsStream, nil, 5*time.Second); err != nil {
		t.Fatalf("leader stepdown: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for l := leader(); l == "" || l == before; l = leader() {
		if time.Now().After(deadline) {
			t.Fatalf("FLEET_CMDS' leader stayed %s", before)
		}
		time.Sleep(100 * time.Millisecond)
	}
	count := func() uint64 {
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(events.CommandSubject("local", "t1", events.VerbCreate)))
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Msgs
	}
	again, err := bus.PublishCreate(ctx, c, "planner", cmd, 0)
	if err != nil {
		t.Fatal(err)
	}
	if again != first || count() != 1 {
		t.Fatalf("republished command stored again: seq %d (first %d), %d messages", again, first, count())
	}
	// Without the Msg-Id the same command is doubled.
	raw, err := s.GetMsg(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	bare := &nats.Msg{Subject: raw.Subject, Data: raw.Data, Header: nats.Header{}}
	if _, err := c.JS.PublishMsg(ctx, bare); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 2 {
		t.Fatalf("the command without its Msg-Id: %d messages, want 2 (doubled)", n)
	}
}
