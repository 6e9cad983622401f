package e2e_test

import (
	"context"
	"errors"

	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/deploykeys"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// TestDeployNATSConfigLeastPrivilege starts an in-process server from
// deploy/nats/nats-server.conf with generated nkeys and certificates, and
// checks that admin can bootstrap the topology, that the planner can
// command an agent, that the agent identity can run the agent runtime end
// to end, and that it cannot act as the planner. make test-deploy runs the
// whole system against the real nats-server binary.
func TestDeployNATSConfigLeastPrivilege(t *testing.T) {
	secrets := t.TempDir()
	pubs, err := deploykeys.Generate(deploykeys.Options{Dir: secrets, Agents: []string{"local/t1"}})
	if err != nil {
		t.Fatal(err)
	}
	for id, pub := range pubs {
		t.Setenv(deploykeys.EnvName(id), pub)
	}
	for k, v := range map[string]string{
		"SERVER_NAME": "pf-test", "NATS_LISTEN": "127.0.0.1:-1", "NATS_MONITOR": "127.0.0.1:-1",
		"NATS_STORE_DIR": t.TempDir(),
		"NATS_TLS_CERT":  filepath.Join(secrets, deploykeys.ServerCert), "NATS_TLS_KEY": filepath.Join(secrets, deploykeys.ServerKey),
		"NATS_TLS_CA": filepath.Join(secrets, deploykeys.CACert),
	} {
		t.Setenv(k, v)
	}
	opts, err := server.ProcessConfigFile(filepath.Join("..", "deploy", "nats", "nats-server.conf"))
	if err != nil {
		t.Fatalf("deploy/nats/nats-server.conf does not parse: %v", err)
	}
	srv := bustest.Server(t, opts)

	ctx := testwait.Context(t, 60*time.Second)
	connect := func(id string) *bus.Conn {
		t.Helper()
		c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), Name: id, Replicas: 1,
			NKeyFile: filepath.Join(secrets, id+".nk"), CAFile: filepath.Join(secrets, deploykeys.CACert),
			InboxPrefix: "_INBOX_" + id, NoCreate: id != "admin"}, nil)
		if err != nil {
			t.Fatalf("connect as %s: %v", id, err)
		}
		t.Cleanup(c.Close)
		return c
	}
	planner := connect("planner")
	ectx, ecancel := context.WithTimeout(ctx, 2*time.Second)
	defer ecancel()
	if err := bus.EnsureTopology(ectx, planner); err == nil {
		t.Fatal("the planner may create the topology; only admin may")
	}
	if err := bus.Bootstrap(ctx, connect("admin"), []string{"local/t1"}); err != nil {
		t.Fatalf("admin cannot bootstrap the topology: %v", err)
	}
	agentConn := connect("agent-local-t1")

	drv := agenttest.NewInstant("127.0.0.1:1")
	rt, err := agent.New(agentConn, drv, agent.Config{Info: agent.Info{Entry: "local", Target: "t1", Type: "test"}, HeartbeatInterval: 100 * time.Millisecond}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rt.Run(rctx) }()
	defer func() { rcancel(); <-done }()

	id := "perm-1"
	cmd := events.CreateCommand{ProxyID: id, ProxySpec: events.ProxySpec{Pool: "p", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Port: 3128}, Attempt: 1}
	if _, err := bus.PublishCreate(ctx, planner, "test", cmd, 0); err != nil {
		t.Fatalf("planner cannot publish a command: %v", err)
	}
	store := bus.NewEventStore(planner, "test", nil)
	waitFor(t, 20*time.Second, "the agent's running event", func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, id)
		return err == nil && last != nil && last.Kind == events.ProxyRunning
	})

	// The planner opens a leader term and appends fenced decisions (atomic
	// batches) with its permissions.
	term, err := store.ClaimTerm(ctx, "planner-1", 1)
	if err != nil {
		t.Fatalf("planner cannot open a leader term: %v", err)
	}
	if _, err := store.AppendFenced(ctx, term, events.AggregateProxy, "perm-4", events.ProxyRequested, "perm-4.requested.1", map[string]string{}, &bus.Expect{Seq: 0}); err != nil {
		t.Fatalf("planner cannot append a fenced decision: %v", err)
	}

	// The planner writes and reads its state snapshots.
	obs, err := planner.JS.ObjectStore(ctx, bus.ObjectSnapshots)
	if err != nil {
		t.Fatalf("planner cannot open the snapshot store: %v", err)
	}
	if _, err := obs.PutBytes(ctx, "planner", []byte(`{"snapshot":true}`)); err != nil {
		t.Fatalf("planner cannot write a snapshot: %v", err)
	}
	if b, err := obs.GetBytes(ctx, "planner"); err != nil || string(b) != `{"snapshot":true}` {
		t.Fatalf("planner cannot read its snapshot back: %q, %v", b, err)
	}

	// The agent may not decide (requested) nor command, nor open a term.
	agentStore := bus.NewEventStore(agentConn, "agent", nil)
	short, scancel := context.WithTimeout(ctx, 2*time.Second)
	defer scancel()
	if _, err := agentStore.ClaimTerm(short, "agent", 1); err == nil {
		t.Fatal("the agent user could open a leader term")
	}
	if _, err := agentStore.Append(short, events.AggregateProxy, "perm-2", events.ProxyRequested, "perm-2.requested.1", map[string]string{}, nil); err == nil {
		t.Fatal("the agent user could append a planner decision")
	}
	if _, err := bus.PublishCreate(short, agentConn, "agent", events.CreateCommand{ProxyID: "perm-3", ProxySpec: events.ProxySpec{Pool: "p", Entry: "local", Target: "t1", Instance: events.InstanceName("perm-3"), Port: 1}, Attempt: 1}, 0); err == nil {
		t.Fatal("the agent user could publish a command")
	}
	var perr error
	sub, err := agentConn.NC.SubscribeSync("fleet.api.>")
	if err == nil {
		_ = agentConn.NC.Flush()
		perr = agentConn.NC.LastError()
		_ = sub.Unsubscribe()
	}
	if err == nil && (perr == nil || !errors.Is(perr, nats.ErrPermissionViolation)) {
		t.Fatalf("the agent user could subscribe to the operator API (err %v)", perr)
	}
}
