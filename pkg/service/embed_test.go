package service_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/testnet"
)

// TestStartRefusesAnOpenEmbeddedServer: an embedded server asked to listen
// beyond loopback with no --nats-server-config is refused before anything
// starts. The metrics and NATS ports given are held by the test, so binding
// either would have failed with another error.
func TestStartRefusesAnOpenEmbeddedServer(t *testing.T) {
	t.Setenv("NATS_URL", "")
	t.Setenv("NATS_CONTEXT", "")
	dataDir := filepath.Join(t.TempDir(), "planner")
	_, err := service.Start(context.Background(), "planner", service.Flags{
		Embed: embedded.Start, DataDir: dataDir, LogLevel: "debug",
		Listen:      "0.0.0.0:" + strconv.Itoa(testnet.Refusing(t).Port),
		MetricsAddr: testnet.Refusing(t).String(),
	})
	if !errors.Is(err, bus.ErrEmbedNeedsAuth) {
		t.Fatalf("Start: %v, want ErrEmbedNeedsAuth", err)
	}
	if !strings.Contains(err.Error(), "add --nats-server-config FILE") {
		t.Errorf("the error %q does not say which flag to add", err)
	}
	if _, err := os.Stat(dataDir); !os.IsNotExist(err) {
		t.Errorf("the data directory exists (%v): something started", err)
	}
}

// TestStartEmbedsWithServerConfig: with --nats-server-config defining users
// the service starts its embedded server beyond loopback and is connected.
func TestStartEmbedsWithServerConfig(t *testing.T) {
	t.Setenv("NATS_URL", "")
	t.Setenv("NATS_CONTEXT", "")
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte("authorization { users: [ { user: op, password: op-pw } ] }\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base, err := service.Start(context.Background(), "planner", service.Flags{
		Embed: embedded.Start, DataDir: t.TempDir(), LogLevel: "error",
		Listen: "0.0.0.0:0", NATSServerConfig: conf,
	})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer base.Close()
	if base.Conn.Server == nil || !base.Conn.NC.IsConnected() {
		t.Fatal("no embedded server, or not connected to it")
	}
}
