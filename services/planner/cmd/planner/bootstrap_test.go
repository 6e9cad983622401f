package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
)

// TestBootstrapCreatesWhatServicesBind runs `planner bootstrap` against a
// server with no topology: afterwards the streams, buckets, object store,
// health's consumer and each named agent's consumer exist.
func TestBootstrapCreatesWhatServicesBind(t *testing.T) {
	srv := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Start from nothing: bustest created the topology.
	for _, s := range []string{bus.EventsStream, bus.CommandsStream, "KV_" + bus.BucketAgents, "OBJ_" + bus.ObjectSnapshots} {
		if err := srv.JS.DeleteStream(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	out, err := plannerCmd(t, "bootstrap", "--nats-url", srv.ClientURL(), "--data-dir", t.TempDir(),
		"--agent", "local/t1", "--agent", "kvm/host2").CombinedOutput()
	if err != nil {
		t.Fatalf("planner bootstrap: %v\n%s", err, out)
	}
	for _, s := range []string{bus.EventsStream, bus.CommandsStream, "KV_" + bus.BucketAgents, "OBJ_" + bus.ObjectSnapshots} {
		if _, err := srv.JS.Stream(ctx, s); err != nil {
			t.Errorf("stream %s after bootstrap: %v", s, err)
		}
	}
	for _, c := range []struct{ stream, name, filter string }{
		{bus.EventsStream, bus.HealthProjection, "fleet.evt.>"},
		{bus.CommandsStream, "agent-local-t1", "fleet.cmd.local.t1.>"},
		{bus.CommandsStream, "agent-kvm-host2", "fleet.cmd.kvm.host2.>"},
	} {
		cons, err := srv.JS.Consumer(ctx, c.stream, c.name)
		if err != nil {
			t.Errorf("consumer %s after bootstrap: %v", c.name, err)
			continue
		}
		if cfg := cons.CachedInfo().Config; cfg.FilterSubject != c.filter || cfg.AckPolicy != jetstream.AckExplicitPolicy {
			t.Errorf("consumer %s: filter %q, ack %v", c.name, cfg.FilterSubject, cfg.AckPolicy)
		}
	}
}

func TestBootstrapBadInput(t *testing.T) {
	out, err := plannerCmd(t, "bootstrap", "--nats-url", "nats://127.0.0.1:1", "--agent", "local.t1").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "ENTRY/TARGET") {
		t.Fatalf("bad --agent: %v\n%s", err, out)
	}
	out, err = plannerCmd(t, "bootstrap", "--agent", "local/t1").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--nats-url") {
		t.Fatalf("no URL: %v\n%s", err, out)
	}
	out, err = plannerCmd(t, "bootstrap", "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "agent-ENTRY-TARGET") || !strings.Contains(string(out), "--ensure-topology=false") {
		t.Fatalf("bootstrap --help: %v\n%s", err, out)
	}
}
