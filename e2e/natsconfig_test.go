package e2e_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: secrets, Agents: []string{"local/t1"}}); err != nil {
		t.Fatal(err)
	}
	srv := bustest.DeployServer(t, filepath.Join("..", "deploy", "nats"), secrets)
	ctx := testwait.Context(t, 60*time.Second)
	connect := func(id string) *bus.Conn { return bustest.ConnectAs(t, ctx, srv.ClientURL(), secrets, id) }
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

	// The planner speaks for the external pools' proxies as the reserved
	// agent external/external (running, deleted), and for no other agent.
	ext := bus.NewEventStore(planner, events.AgentSource(events.ProviderExternal, events.ProviderExternal), nil)
	if _, err := ext.Append(ctx, events.AggregateProxy, "perm-5", events.ProxyRunning, "perm-5.running.1", events.ProxyRunningData{Address: "203.0.113.7:3128", Attempt: 1}, nil); err != nil {
		t.Fatalf("planner cannot append the external agent's running: %v", err)
	}
	for _, c := range []struct{ source, typ string }{
		{events.AgentSource("local", "t1"), events.ProxyRunning},
		{events.AgentSource(events.ProviderExternal, events.ProviderExternal), events.ProxyProvisioning},
	} {
		short, scancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := bus.NewEventStore(planner, c.source, nil).Append(short, events.AggregateProxy, "perm-6", c.typ, "perm-6."+c.typ+".1", events.ProxyRunningData{Address: "203.0.113.7:3128", Attempt: 1}, nil)
		scancel()
		if err == nil {
			t.Fatalf("the planner could append %s as %s", c.typ, c.source)
		}
	}
	// It reads the gateways' cooldowns.
	cool, err := planner.JS.KeyValue(ctx, bus.BucketGatewayCooldowns)
	if err != nil {
		t.Fatalf("planner cannot open %s: %v", bus.BucketGatewayCooldowns, err)
	}
	if _, err := cool.Get(ctx, "none.x"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("planner cannot read %s: %v", bus.BucketGatewayCooldowns, err)
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

// TestDeployAccountsShippedIsGenerated: deploy/nats/accounts.conf is what
// `make deploy-secrets` writes for the defaults (agent local/t1, gateway
// gw-1), so the shipped gateway permissions are the generated ones.
func TestDeployAccountsShippedIsGenerated(t *testing.T) {
	shipped, err := os.ReadFile(filepath.Join("..", "deploy", "nats", deploykeys.AccountsFile))
	if err != nil {
		t.Fatal(err)
	}
	want := deploykeys.Accounts([]string{"agent-local-t1"}, []string{deploykeys.DefaultGateway})
	if string(shipped) != want {
		t.Fatalf("deploy/nats/%s differs from what deploy-secrets writes for agent local/t1 and gateway %s; write it again from deploykeys.Accounts:\n%s",
			deploykeys.AccountsFile, deploykeys.DefaultGateway, want)
	}
}

// TestDeployNATSConfigGatewayIdentities runs deploy/nats with the accounts
// deploy-secrets writes for two gateways, gw-1 and gw-2: each writes its
// own demand keys and request log and serves its own endpoints, and is
// refused the other's; the operator reads the gateways' CA certificate
// but not its key. (The buckets the gateways share are created here as
// admin when the topology does not declare them yet.)
func TestDeployNATSConfigGatewayIdentities(t *testing.T) {
	secrets := t.TempDir()
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: secrets, Agents: []string{"local/t1"}, Gateways: []string{"gw-1", "gw-2"}}); err != nil {
		t.Fatal(err)
	}
	conf := t.TempDir()
	for _, f := range []string{filepath.Join("..", "deploy", "nats", "nats-server.conf"), filepath.Join("..", "deploy", "nats", "permissions.conf"), filepath.Join(secrets, deploykeys.AccountsFile)} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(conf, filepath.Base(f)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	srv := bustest.DeployServer(t, conf, secrets)
	ctx := testwait.Context(t, 60*time.Second)
	admin := bustest.ConnectAs(t, ctx, srv.ClientURL(), secrets, "admin")
	if err := bus.Bootstrap(ctx, admin, []string{"local/t1"}); err != nil {
		t.Fatal(err)
	}
	ensureGatewayBuckets(t, ctx, admin)
	gw1 := bustest.ConnectAs(t, ctx, srv.ClientURL(), secrets, deploykeys.GatewayIdentity("gw-1"))
	operator := bustest.ConnectAs(t, ctx, srv.ClientURL(), secrets, "operator")
	violations := permissionErrors(gw1)
	opViolations := permissionErrors(operator)

	// Its own: demand, request log (stored), endpoints, shared state.
	demand, err := gw1.JS.KeyValue(ctx, bus.BucketDemand)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := demand.Put(ctx, events.DemandKey("dep", "gw-1"), []byte(`{}`)); err != nil {
		t.Fatalf("gw-1 writes its own demand: %v", err)
	}
	if _, err := gw1.JS.Publish(ctx, events.GatewayLogSubject("gw-1"), []byte(`{}`)); err != nil {
		t.Fatalf("gw-1 publishes its request log: %v", err)
	}
	for _, ep := range []string{events.GatewayInfo, events.GatewayStats, events.GatewayCA} {
		if err := subscribeRefused(gw1, violations, events.GatewaySubject("gw-1", ep)); err != nil {
			t.Fatalf("gw-1 may not serve its own %s: %v", ep, err)
		}
	}
	ca, err := gw1.JS.KeyValue(ctx, deploykeys.BucketGatewayCA)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"cert", "key"} {
		if _, err := ca.Create(ctx, k, []byte("ca-"+k)); err != nil {
			t.Fatalf("gw-1 creates the CA's %s: %v", k, err)
		}
		if e, err := ca.Get(ctx, k); err != nil || string(e.Value()) != "ca-"+k {
			t.Fatalf("gw-1 reads the CA's %s: %v", k, err)
		}
	}
	for _, b := range []string{deploykeys.BucketGatewayCooldowns, deploykeys.BucketGatewaySessions} {
		kv, err := gw1.JS.KeyValue(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Put(ctx, "example_com.p1", []byte("x")); err != nil {
			t.Fatalf("gw-1 writes %s: %v", b, err)
		}
		okv, err := operator.JS.KeyValue(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := okv.Get(ctx, "example_com.p1"); err != nil {
			t.Fatalf("the operator reads %s: %v", b, err)
		}
	}

	// The other gateway's: refused, and nothing reached the streams.
	for _, subj := range []string{"$KV." + bus.BucketDemand + "." + events.DemandKey("dep", "gw-2"), events.GatewayLogSubject("gw-2")} {
		if err := publishRefused(ctx, gw1, violations, subj); err != nil {
			t.Errorf("gw-1 publishes %s: %v", subj, err)
		}
	}
	adminDemand, err := admin.JS.KeyValue(ctx, bus.BucketDemand)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adminDemand.Get(ctx, events.DemandKey("dep", "gw-2")); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("gw-2's demand key after gw-1's refused write: %v, want not found", err)
	}
	for _, subj := range []string{
		events.GatewaySubject("gw-2", events.GatewayInfo), events.GatewaySubject("gw-2", events.GatewayStats),
		events.GatewaySubject("gw-2", events.GatewayCA), deploykeys.GatewayInbox("gw-2") + ".>", "fleet.gateway.>",
	} {
		if err := subscribeRefused(gw1, violations, subj); err == nil {
			t.Errorf("gw-1 may subscribe to %s", subj)
		}
	}

	// The operator reads the CA's certificate, never its key.
	ocert, err := operator.NC.RequestWithContext(ctx, "$JS.API.DIRECT.GET.KV_"+deploykeys.BucketGatewayCA+".$KV."+deploykeys.BucketGatewayCA+".cert", nil)
	if err != nil || string(ocert.Data) != "ca-cert" {
		t.Fatalf("the operator direct-gets the CA certificate: %v", err)
	}
	for _, subj := range []string{
		"$JS.API.DIRECT.GET.KV_" + deploykeys.BucketGatewayCA + ".$KV." + deploykeys.BucketGatewayCA + ".key",
		"$JS.API.STREAM.MSG.GET.KV_" + deploykeys.BucketGatewayCA,
		"$JS.API.CONSUMER.CREATE.KV_" + deploykeys.BucketGatewayCA + ".spy.$KV." + deploykeys.BucketGatewayCA + ".key",
	} {
		if err := publishRefused(ctx, operator, opViolations, subj); err != nil {
			t.Errorf("operator: %v", err)
		}
	}
	if err := subscribeRefused(operator, opViolations, events.GatewayLogAll); err != nil {
		t.Errorf("the operator may not follow the request log: %v", err)
	}
}

// ensureGatewayBuckets checks that the topology made the gateways' shared
// buckets (the CA, cooldowns, sessions) the permissions name.
func ensureGatewayBuckets(t *testing.T, ctx context.Context, admin *bus.Conn) {
	t.Helper()
	for _, b := range []string{deploykeys.BucketGatewayCA, deploykeys.BucketGatewayCooldowns, deploykeys.BucketGatewaySessions} {
		if _, err := admin.JS.KeyValue(ctx, b); err != nil {
			t.Fatalf("bucket %s, which the gateways' permissions name: %v (the topology declares it)", b, err)
		}
	}
}

// permissionErrors collects c's permission violations.
func permissionErrors(c *bus.Conn) <-chan error {
	ch := make(chan error, 64)
	c.NC.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case ch <- err:
			default:
			}
		}
	})
	return ch
}

// violation waits for the server's permission violation naming subject;
// nil when none came.
func violation(errs <-chan error, subject string) error {
	deadline := time.After(2 * time.Second)
	for {
		select {
		case err := <-errs:
			if strings.Contains(err.Error(), `"`+subject+`"`) {
				return err
			}
		case <-deadline:
			return nil
		}
	}
}

// subscribeRefused subscribes c to subject and returns the server's
// refusal (nil: allowed).
func subscribeRefused(c *bus.Conn, errs <-chan error, subject string) error {
	sub, err := c.NC.SubscribeSync(subject)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = c.NC.Flush()
	return violation(errs, subject)
}

// publishRefused publishes to subject as c, which the server must refuse
// with a permission violation naming subject. The flush returns after the
// server answered the publish, so the violation is on its way by then.
func publishRefused(ctx context.Context, c *bus.Conn, errs <-chan error, subject string) error {
	if err := c.NC.Publish(subject, []byte(`{}`)); err != nil {
		return err
	}
	if err := c.NC.FlushWithContext(ctx); err != nil {
		return err
	}
	if violation(errs, subject) == nil {
		return errors.New("no permission violation: allowed, want refused")
	}
	return nil
}

// TestDeployBackupIdentity runs deploy/nats as shipped and connects as the
// backup identity of scripts/backup.sh: it lists the streams, reads their
// info and takes a snapshot (acknowledging its chunks), and the server
// refuses everything that changes state: deleting, purging, updating or
// restoring a stream, creating a consumer, deleting a message, writing a
// bucket, appending an event, calling the API. Nothing changed afterwards.
// make test-restore backs up with this identity through the nats CLI.
func TestDeployBackupIdentity(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	url, secrets, admin := bustest.DeployFleet(t, ctx, filepath.Join("..", "deploy", "nats"))
	// Events enough for a snapshot of several chunks (random, so that
	// compression keeps them large).
	for i := range 16 {
		pad := make([]byte, 512)
		_, _ = rand.Read(pad)
		if _, err := bus.NewEventStore(admin, "test", nil).Append(ctx, events.AggregatePool, "bk", events.PoolApplied, fmt.Sprintf("bk.applied.%d", i),
			map[string]any{"name": "bk", "provider": "local", "size": 1, "pad": hex.EncodeToString(pad)}, nil); err != nil {
			t.Fatal(err)
		}
	}
	backup := bustest.ConnectAs(t, ctx, url, secrets, "backup")
	violations := permissionErrors(backup)

	// What a backup does.
	var names []string
	for n := range backup.JS.StreamNames(ctx).Name() {
		names = append(names, n)
	}
	for _, want := range []string{bus.EventsStream, bus.CommandsStream, "KV_" + bus.BucketSecrets, "OBJ_" + bus.ObjectSnapshots} {
		if !slices.Contains(names, want) {
			t.Fatalf("backup lists the streams %v: %s is missing", names, want)
		}
	}
	before, err := backup.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatalf("backup reads %s's info: %v", bus.EventsStream, err)
	}
	snapshot(t, ctx, backup, violations, bus.EventsStream)

	// What it may not do: each refused by the server.
	ev := bus.EventsStream
	for _, subj := range []string{
		"$JS.API.STREAM.DELETE." + ev, "$JS.API.STREAM.PURGE." + ev, "$JS.API.STREAM.UPDATE." + ev,
		"$JS.API.STREAM.MSG.DELETE." + ev, "$JS.API.STREAM.CREATE.BK_NEW", "$JS.API.STREAM.RESTORE.BK_NEW",
		"$JS.API.CONSUMER.CREATE." + ev + ".bk-durable", "$JS.API.CONSUMER.DURABLE.CREATE." + ev + ".bk-durable",
		"$JS.API.CONSUMER.DELETE." + ev + "." + bus.HealthProjection,
		"$KV." + bus.BucketPools + ".bk", "$KV." + bus.BucketSecrets + ".bk",
		events.EventSubject(events.AggregatePool, "bk", events.PoolApplied), events.CommandSubject("local", "t1", "create"), events.APISubject("pool", "list"),
	} {
		if err := publishRefused(ctx, backup, violations, subj); err != nil {
			t.Errorf("backup publishes %s: %v", subj, err)
		}
	}
	for _, subj := range []string{"_INBOX.>", "_INBOX_admin.>", "fleet.>"} {
		if err := subscribeRefused(backup, violations, subj); err == nil {
			t.Errorf("backup may subscribe to %s", subj)
		}
	}

	// Nothing changed.
	after, err := admin.JS.Stream(ctx, ev)
	if err != nil {
		t.Fatal(err)
	}
	if b, a := before.CachedInfo(), after.CachedInfo(); a.State.Msgs != b.State.Msgs || a.State.LastSeq != b.State.LastSeq ||
		a.State.Consumers != b.State.Consumers || !a.Created.Equal(b.Created) {
		t.Errorf("%s changed under the backup identity: before %+v, after %+v", ev, b.State, a.State)
	}
	pools, err := admin.JS.KeyValue(ctx, bus.BucketPools)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Get(ctx, "bk"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("%s bk after the refused write: %v, want not found", bus.BucketPools, err)
	}
	if _, err := admin.JS.Stream(ctx, "BK_NEW"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("stream BK_NEW after the refused create and restore: %v, want not found", err)
	}
}

// snapshot takes a snapshot of stream as c, as the nats CLI's backup
// does: the chunks come to c's inbox, each acknowledged on its reply
// subject ($JS.SNAPSHOT.ACK...), until the empty end of the snapshot. A
// window of one chunk makes the server wait for each acknowledgement, so
// a refused one ends the snapshot with an error status instead of 204.
func snapshot(t *testing.T, ctx context.Context, c *bus.Conn, violations <-chan error, stream string) {
	t.Helper()
	inbox := c.NC.NewRespInbox()
	sub, err := c.NC.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	req, _ := json.Marshal(map[string]any{"deliver_subject": inbox, "chunk_size": 1024, "window_size": 1024})
	resp, err := c.NC.RequestWithContext(ctx, "$JS.API.STREAM.SNAPSHOT."+stream, req)
	if err != nil {
		t.Fatalf("snapshot of %s: %v", stream, err)
	}
	var r struct {
		Error *struct {
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &r); err != nil || r.Error != nil {
		t.Fatalf("snapshot of %s refused: %s", stream, resp.Data)
	}
	n, ack := 0, ""
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			t.Fatalf("snapshot of %s after %d bytes: %v", stream, n, err)
		}
		if len(m.Data) == 0 { // the end
			if status := m.Header.Get("Status"); status != "204" {
				t.Fatalf("the snapshot of %s ended with status %q (%s) after %d bytes, want 204", stream, status, m.Header.Get("Description"), n)
			}
			break
		}
		n += len(m.Data)
		if m.Reply != "" {
			ack = m.Reply
			if err := c.NC.Publish(m.Reply, nil); err != nil {
				t.Fatalf("acknowledge a snapshot chunk: %v", err)
			}
		}
	}
	if n == 0 || ack == "" {
		t.Fatalf("the snapshot of %s: %d bytes, acknowledgement subject %q; want data and chunks to acknowledge", stream, n, ack)
	}
	if err := c.NC.FlushWithContext(ctx); err != nil {
		t.Fatal(err)
	}
	if err := violation(violations, ack); err != nil {
		t.Fatalf("the snapshot's acknowledgement was refused: %v", err)
	}
}
