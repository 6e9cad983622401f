package embedded_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
)

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "nats-server.conf")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

const usersConfig = `
authorization {
  users: [ { user: operator, password: "op-pw-3f9a" } ]
}
`

const accountsConfig = `
accounts {
  FLEET {
    jetstream: enabled
    users: [ { user: operator, password: "op-pw-3f9a" } ]
  }
  SYS {}
}
system_account: SYS
`

// TestNonLoopbackWithoutAuthRefuses: the server is refused before it
// creates its store or binds: the port asked for is held by the test, so a
// bind attempt would fail with another error.
func TestNonLoopbackWithoutAuthRefuses(t *testing.T) {
	port := strconv.Itoa(testnet.Refusing(t).Port)
	for _, c := range []struct {
		name, listen, config, want string
	}{
		{"all interfaces, no config", "0.0.0.0:" + port, "", "add --nats-server-config FILE"},
		{"empty host", ":" + port, "", "add --nats-server-config FILE"},
		{"ipv6 any", "[::]:" + port, "", "add --nats-server-config FILE"},
		{"a host name", "proxyfleet.example:" + port, "", "add --nats-server-config FILE"},
		{"config without users", "0.0.0.0:" + port, "jetstream {}\n", "defines no users or nkeys"},
		{"config listen, no users", "", "listen: 0.0.0.0:" + port + "\n", "defines no users or nkeys"},
		{"no_auth_user", "0.0.0.0:" + port, usersConfig + "no_auth_user: operator\n", "sets no_auth_user operator"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dataDir := filepath.Join(t.TempDir(), "jetstream")
			cfg := bus.Config{DataDir: dataDir, Listen: c.listen, PortsFileDir: t.TempDir()}
			if c.config != "" {
				cfg.ServerConfig = writeConfig(t, c.config)
			}
			srv, err := embedded.Start(cfg, nil)
			if err == nil {
				srv.Shutdown()
				t.Fatal("Start succeeded")
			}
			if !errors.Is(err, bus.ErrEmbedNeedsAuth) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Start: %v; want ErrEmbedNeedsAuth saying %q", err, c.want)
			}
			if _, err := os.Stat(dataDir); !os.IsNotExist(err) {
				t.Errorf("the store directory exists (%v): something started", err)
			}
			if ents, _ := os.ReadDir(cfg.PortsFileDir); len(ents) != 0 {
				t.Errorf("a ports file was written: something listened")
			}
		})
	}
}

func TestUnsupportedAuthConfigurationsAreRefused(t *testing.T) {
	for _, c := range []struct{ name, config, want string }{
		{"token", "authorization { token: s3cr3t }\n", "a single token or user"},
		{"single user", "authorization { user: a, password: b }\n", "a single token or user"},
		{"two accounts", "accounts { A { users: [{user: a, password: b}] }, B { users: [{user: c, password: d}] } }\n", "defines the accounts A, B"},
		{"syntax", "authorization {", "NATS server configuration"},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv, err := embedded.Start(bus.Config{DataDir: t.TempDir(), Listen: "127.0.0.1:0", ServerConfig: writeConfig(t, c.config)}, nil)
			if err == nil {
				srv.Shutdown()
				t.Fatal("Start succeeded")
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Start: %v; want it to say %q", err, c.want)
			}
		})
	}
}

// TestAuthenticatedServerBeyondLoopback listens on every interface with a
// configuration that defines users: the embedding service is in (in-process,
// with its own identity, in the file's account, able to create the
// topology), an external client without or with wrong credentials is
// refused, and one with a user of the file works in the same account.
func TestAuthenticatedServerBeyondLoopback(t *testing.T) {
	for _, c := range []struct{ name, config string }{
		{"users", usersConfig},
		{"accounts", accountsConfig},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			conn, err := bus.Connect(ctx, bus.Config{
				Name: "embedder", DataDir: t.TempDir(), Listen: "0.0.0.0:0",
				ServerConfig: writeConfig(t, c.config), Embed: embedded.Start,
			}, nil)
			if err != nil {
				t.Fatalf("Connect: %v", err)
			}
			defer conn.Close()
			if err := bus.EnsureTopology(ctx, conn); err != nil {
				t.Fatalf("the embedding service cannot create the topology: %v", err)
			}
			url := "nats://" + loopbackAddr(t, conn)

			if nc, err := nats.Connect(url); err == nil {
				nc.Close()
				t.Fatal("a client without credentials was let in")
			} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
				t.Errorf("anonymous client: %v, want an authorization violation", err)
			}
			if nc, err := nats.Connect(url, nats.UserInfo("operator", "wrong")); err == nil {
				nc.Close()
				t.Fatal("a client with a wrong password was let in")
			}
			nc, err := nats.Connect(url, nats.UserInfo("operator", "op-pw-3f9a"))
			if err != nil {
				t.Fatalf("the file's user: %v", err)
			}
			defer nc.Close()
			js, err := nc.JetStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := js.StreamInfo(bus.EventsStream); err != nil {
				t.Errorf("the file's user does not see the embedding service's stream %s: %v", bus.EventsStream, err)
			}
		})
	}
}

// TestLoopbackNeedsNoAuth: make run's case, unchanged: no configuration,
// a loopback listener, and any local client gets in.
func TestLoopbackNeedsNoAuth(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	conn, err := bus.Connect(ctx, bus.Config{Name: "embedder", DataDir: t.TempDir(), Listen: "127.0.0.1:0", Embed: embedded.Start}, nil)
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	defer conn.Close()
	nc, err := nats.Connect(conn.ClientURL())
	if err != nil {
		t.Fatalf("anonymous client on loopback: %v", err)
	}
	nc.Close()
}

// loopbackAddr is 127.0.0.1 and the port the embedded server listens on.
func loopbackAddr(t *testing.T, conn *bus.Conn) string {
	t.Helper()
	srv, ok := conn.Server.(*embedded.Server)
	if !ok {
		t.Fatalf("conn.Server is a %T", conn.Server)
	}
	_, port, err := net.SplitHostPort(srv.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", port)
}
