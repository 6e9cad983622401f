package bustest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/deploykeys"
)

// DeployServer starts an in-process server from dir's nats-server.conf
// (deploy/nats) with the keys and certificates in secrets, as written by
// deploykeys: the shipped configuration, for tests of its permissions.
func DeployServer(t *testing.T, dir, secrets string) *server.Server {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(secrets, deploykeys.EnvFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(l, "#") {
			t.Setenv(k, v)
		}
	}
	for k, v := range map[string]string{
		"SERVER_NAME": "pf-test", "NATS_LISTEN": "127.0.0.1:-1", "NATS_MONITOR": "127.0.0.1:-1",
		"NATS_STORE_DIR": t.TempDir(),
		"NATS_TLS_CERT":  filepath.Join(secrets, deploykeys.ServerCert), "NATS_TLS_KEY": filepath.Join(secrets, deploykeys.ServerKey),
		"NATS_TLS_CA": filepath.Join(secrets, deploykeys.CACert),
	} {
		t.Setenv(k, v)
	}
	opts, err := server.ProcessConfigFile(filepath.Join(dir, "nats-server.conf"))
	if err != nil {
		t.Fatalf("%s/nats-server.conf does not parse: %v", dir, err)
	}
	return Server(t, opts)
}

// ConnectAs connects to url as deploy identity id with its seed in secrets
// and its own inbox prefix, as a service started with
// --ensure-topology=false (admin excepted).
func ConnectAs(t *testing.T, ctx context.Context, url, secrets, id string) *bus.Conn {
	t.Helper()
	c, err := bus.Connect(ctx, bus.Config{URL: url, Name: id, Replicas: 1,
		NKeyFile: filepath.Join(secrets, id+".nk"), CAFile: filepath.Join(secrets, deploykeys.CACert),
		InboxPrefix: "_INBOX_" + id, NoCreate: id != "admin"}, nil)
	if err != nil {
		t.Fatalf("connect as %s: %v", id, err)
	}
	t.Cleanup(c.Close)
	return c
}

// DeployFleet starts deploy/nats as shipped (dir holds its
// nats-server.conf) with keys generated for agent local/t1 and the default
// gateway, and bootstraps the topology as admin: what a test of one
// identity's permissions starts from. It returns the server's URL, the
// secrets directory (for [ConnectAs]) and the admin connection.
func DeployFleet(t *testing.T, ctx context.Context, dir string) (url, secrets string, admin *bus.Conn) {
	t.Helper()
	secrets = t.TempDir()
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: secrets, Agents: []string{"local/t1"}}); err != nil {
		t.Fatal(err)
	}
	url = DeployServer(t, dir, secrets).ClientURL()
	admin = ConnectAs(t, ctx, url, secrets, "admin")
	if err := bus.Bootstrap(ctx, admin, []string{"local/t1"}); err != nil {
		t.Fatalf("bootstrap as admin: %v", err)
	}
	return url, secrets, admin
}
