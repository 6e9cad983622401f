package bus_test

import (
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
)

// A service given the URL of a single server (as `make run` does) must not
// ask for replicated streams, which such a server refuses.
func TestConnectToSingleServerUsesOneReplica(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	srv := bustest.Start(t)
	c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), Name: t.Name()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := c.Replicas(); got != 1 {
		t.Fatalf("Replicas() = %d, want 1 for a single server", got)
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatalf("EnsureTopology over a URL to a single server: %v", err)
	}
	explicit, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), Name: t.Name(), Replicas: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer explicit.Close()
	if got := explicit.Replicas(); got != 1 {
		t.Fatalf("explicit Replicas() = %d, want 1", got)
	}
}
