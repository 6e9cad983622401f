package bus_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
)

// dialNoCreate connects to srv's server as a service started with
// --ensure-topology=false.
func dialNoCreate(t *testing.T, srv *bus.Conn) *bus.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), Replicas: 1, NoCreate: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func TestAgentConsumerIsBoundNotCreatedWithoutCreateRights(t *testing.T) {
	srv := bustest.Start(t)
	c := dialNoCreate(t, srv)
	if c.MayCreate() {
		t.Fatal("a connection with NoCreate may create")
	}
	ctx := testwait.Context(t, 10*time.Second)

	_, err := bus.EnsureAgentConsumer(ctx, c, "local", "t1")
	if err == nil || !strings.Contains(err.Error(), "planner bootstrap") || !strings.Contains(err.Error(), "agent-local-t1") {
		t.Fatalf("missing consumer: got %v, want an error naming agent-local-t1 and planner bootstrap", err)
	}
	if _, err := srv.JS.Consumer(ctx, bus.CommandsStream, "agent-local-t1"); err == nil {
		t.Fatal("EnsureAgentConsumer created the consumer on a connection that may not")
	}

	if err := bus.Bootstrap(ctx, srv, []string{"local/t1", "kvm/host-2"}); err != nil {
		t.Fatal(err)
	}
	cons, err := bus.EnsureAgentConsumer(ctx, c, "local", "t1")
	if err != nil {
		t.Fatalf("bind the bootstrapped consumer: %v", err)
	}
	if f := cons.CachedInfo().Config.FilterSubject; f != "fleet.cmd.local.t1.>" {
		t.Fatalf("bound consumer filters %q", f)
	}
	info, err := srv.JS.Consumer(ctx, bus.CommandsStream, "agent-kvm-host-2")
	if err != nil || info.CachedInfo().Config.FilterSubject != "fleet.cmd.kvm.host-2.>" {
		t.Fatalf("bootstrap did not create agent-kvm-host-2 with its filter: %v", err)
	}
	if _, err := srv.JS.Consumer(ctx, bus.EventsStream, bus.HealthProjection); err != nil {
		t.Fatalf("bootstrap did not create %s: %v", bus.HealthProjection, err)
	}
	// A connection that may create still creates (make run, tests).
	if !srv.MayCreate() {
		t.Fatal("the embedded connection may not create")
	}
}

func TestParseAgent(t *testing.T) {
	for _, ok := range []string{"local/t1", "kvm/host-2"} {
		if _, _, err := bus.ParseAgent(ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "local", "local/", "/t1", "local/t.1", "lo*cal/t1", "local/t1/x", "local/t 1"} {
		if _, _, err := bus.ParseAgent(bad); err == nil || !strings.Contains(err.Error(), "ENTRY/TARGET") {
			t.Errorf("%q: got %v, want an error naming ENTRY/TARGET", bad, err)
		}
	}
	ctx := context.Background()
	if err := bus.Bootstrap(ctx, bustest.Start(t), []string{"bad"}); err == nil {
		t.Fatal("bootstrap accepted a bad agent")
	}
}

func TestConnectWithNKeyAndBadTLSOptions(t *testing.T) {
	srv := bustest.Start(t)
	ctx := testwait.Context(t, 10*time.Second)
	dir := t.TempDir()
	kp, _ := nkeys.CreateUser()
	seed, _ := kp.Seed()
	seedFile := filepath.Join(dir, "svc.nk")
	if err := os.WriteFile(seedFile, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]bus.Config{
		"creds and nkey":   {URL: srv.ClientURL(), CredsFile: seedFile, NKeyFile: seedFile},
		"cert without key": {URL: srv.ClientURL(), CertFile: seedFile},
		"missing nkey":     {URL: srv.ClientURL(), NKeyFile: filepath.Join(dir, "none.nk")},
		"missing CA":       {URL: srv.ClientURL(), CAFile: filepath.Join(dir, "none.crt")},
	} {
		if c, err := bus.Connect(ctx, cfg, nil); err == nil {
			c.Close()
			t.Errorf("%s: connected, want an error", name)
		}
	}
}
