package fleet

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/route"
)

// TestRunUnderAnotherGatewaysIdentityFails: on a server where the
// gateway's user may serve only gateway gw-2's subjects, as deploy/nats
// allows identity gateway-gw-2, a gateway started with --name gw-1 stops
// at once with an error naming the refused subject and --name.
func TestRunUnderAnotherGatewaysIdentityFails(t *testing.T) {
	srv := bustest.Server(t, &server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{
			{Username: "admin", Password: "admin"},
			{Username: "gw-2", Password: "gw-2", Permissions: &server.Permissions{
				Publish:   &server.SubjectPermission{Allow: []string{">"}},
				Subscribe: &server.SubjectPermission{Allow: []string{"_INBOX.>", "$SRV.>", "fleet.gateway.gw-2.>"}},
			}},
		}})
	ctx := testwait.Context(t, 30*time.Second)
	dial := func(user string) *bus.Conn {
		c, err := bus.Connect(ctx, bus.Config{URL: srv.ClientURL(), User: user, Password: user, Replicas: 1, NoCreate: user != "admin"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		return c
	}
	if err := bus.EnsureTopology(ctx, dial("admin")); err != nil {
		t.Fatal(err)
	}
	conn := dial("gw-2")
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	run := func(name string) (error, bool) {
		table := route.NewTable(route.Limits{}, nil)
		f, err := New(conn, table, Config{Name: name, Key: key, Listen: "127.0.0.1:8888"}, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		fwd := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil }})
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		err = f.Run(rctx, fwd)
		return err, rctx.Err() == nil
	}
	err, early := run("gw-1")
	if err == nil || !early || !strings.Contains(err.Error(), `"fleet.gateway.gw-1.`) || !strings.Contains(err.Error(), "--name") {
		t.Fatalf("gateway gw-1 under gw-2's identity: %v (stopped early: %v); want it to stop at once naming the subject and --name", err, early)
	}
	// Under its own name it runs until stopped.
	if err, early := run("gw-2"); err != nil || early {
		t.Fatalf("gateway gw-2 under its own identity: %v (stopped early: %v); want it to run", err, early)
	}
}
