// Package bustest starts a real embedded JetStream server for tests: one per
// test, on a random loopback port, storing under t.TempDir(); [Server]
// starts one with options of the test's own.
package bustest

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/embedded"
)

// Start embeds a JetStream server for t, creates the proxyfleet topology and
// returns a connection to it. Everything is stopped by t.Cleanup.
func Start(t testing.TB) *bus.Conn {
	t.Helper()
	return StartIn(t, t.TempDir())
}

// StartIn is [Start] with an explicit store directory, so a test can stop
// the server and start another on the same data (a NATS restart).
func StartIn(t testing.TB, dir string) *bus.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := bus.Connect(ctx, bus.Config{DataDir: dir, Listen: "127.0.0.1:-1", Name: t.Name(), Embed: embedded.Start}, nil)
	if err != nil {
		t.Fatalf("embedded NATS: %v", err)
	}
	t.Cleanup(c.Close)
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatalf("topology: %v", err)
	}
	return c
}

// Server starts a nats-server with opts, for a test that needs what
// [Start] does not set up (users, a cluster, a shipped configuration): it
// runs without logging or signal handlers, is ready for connections when
// Server returns, and is shut down when the test ends.
func Server(t testing.TB, opts *server.Options) *server.Server {
	t.Helper()
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats-server: %v", err)
	}
	go srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	return srv
}

// Dial opens another client connection to the server behind c, as a separate
// service would.
func Dial(t testing.TB, c *bus.Conn) *bus.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := bus.Connect(ctx, bus.Config{URL: c.ClientURL(), Name: t.Name(), Replicas: 1}, nil)
	if err != nil {
		t.Fatalf("dial NATS: %v", err)
	}
	t.Cleanup(d.Close)
	return d
}
