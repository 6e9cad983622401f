package bus_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/testwait"
)

// TestConnectWithNATSContext connects through a nats CLI context file to a
// server that demands a user and password.
func TestConnectWithNATSContext(t *testing.T) {
	srv := bustest.Server(t, &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		Username: "fleet", Password: "s3cret"})

	xdg := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", xdg)
	dir := filepath.Join(xdg, "nats", "context")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name+".json"), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("prod", `{"description":"test","url":"`+srv.ClientURL()+`","user":"fleet","password":"s3cret","color_scheme":"dark"}`)
	write("wrong", `{"url":"`+srv.ClientURL()+`","user":"fleet","password":"nope"}`)
	write("jwt", `{"url":"`+srv.ClientURL()+`","user_jwt":"eyJ"}`)

	ctx := testwait.Context(t, 20*time.Second)
	c, err := bus.Connect(ctx, bus.Config{Context: "prod", Name: "ctx-test", Embed: embedded.Start, DataDir: t.TempDir()}, nil)
	if err != nil {
		t.Fatalf("connect with context prod: %v", err)
	}
	if c.Server != nil || c.Replicas() != 1 {
		t.Fatalf("a context must connect, not embed (server %v, replicas %d)", c.Server, c.Replicas())
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatalf("topology through the context: %v", err)
	}
	c.Close()

	// A context's inbox prefix, like Config.InboxPrefix, names the
	// connection's reply subjects (deploy/nats allows each identity only its
	// own).
	write("inbox", `{"url":"`+srv.ClientURL()+`","user":"fleet","password":"s3cret","inbox_prefix":"_INBOX_ops"}`)
	for name, cfg := range map[string]bus.Config{
		"context": {Context: "inbox"},
		"config":  {URL: srv.ClientURL(), User: "fleet", Password: "s3cret", InboxPrefix: "_INBOX_ops"},
	} {
		c, err := bus.Connect(ctx, cfg, nil)
		if err != nil {
			t.Fatalf("%s with an inbox prefix: %v", name, err)
		}
		if in := c.NC.NewRespInbox(); !strings.HasPrefix(in, "_INBOX_ops.") {
			t.Errorf("%s: reply subject %s, want prefix _INBOX_ops.", name, in)
		}
		c.Close()
	}

	cases := []struct{ name, want string }{
		{"wrong", "Authorization"},
		{"jwt", "user_jwt"},
		{"missing", "missing.json"},
	}
	for _, tc := range cases {
		_, err := bus.Connect(ctx, bus.Config{Context: tc.name}, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("context %s: got %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

// TestConnectNeedsAServer: without a URL or a context, a program that does
// not embed gets ErrNoServer and nothing is started.
func TestConnectNeedsAServer(t *testing.T) {
	dir := t.TempDir()
	c, err := bus.Connect(context.Background(), bus.Config{DataDir: filepath.Join(dir, "jetstream"), Listen: "127.0.0.1:0", PortsFileDir: dir}, nil)
	if !errors.Is(err, bus.ErrNoServer) || c != nil {
		t.Fatalf("Connect = %v, %v; want ErrNoServer", c, err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("%s holds %d entries; no server should have started", dir, len(entries))
	}
}
