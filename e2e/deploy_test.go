//go:build deploy

package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/deploykeys"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// TestDeployShipped is `make test-deploy`: the shipped deploy/nats files,
// unmodified (only their variables filled from the environment), loaded
// into a real nats-server over TLS with generated nkeys and certificates;
// the topology created by `planner bootstrap` as admin; planner, health,
// local-agent and gateway started with the flags and credential files of
// their shipped systemd units; a pool lifecycle through the operator
// identity, with a crawler's requests through the gateway; then every
// forbidden action is tried and must be refused.
func TestDeployShipped(t *testing.T) {
	natsServer := os.Getenv("PROXYFLEET_NATS_SERVER")
	if natsServer == "" {
		natsServer, _ = exec.LookPath("nats-server")
	}
	testgate.Need(t, natsServer != "", "no nats-server: make test-deploy builds the pinned one and sets PROXYFLEET_NATS_SERVER")
	needBinaries(t)

	// Two gateways, each its own identity: gw-1 runs from its unit, gw-2
	// is the other gateway whose subjects gw-1 must not touch.
	secrets := t.TempDir()
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: secrets, Agents: []string{"local/t1"}, Gateways: []string{"gw-1", "gw-2"}}); err != nil {
		t.Fatal(err)
	}
	d := startDeployServer(t, natsServer, secrets)
	ctx := testwait.Context(t, 5*time.Minute)

	// Bootstrap as admin, with the consumer of a second agent (local/t2)
	// that local/t1 must not be able to bind.
	boot := exec.Command(filepath.Join(binDir, "planner"), "bootstrap", "--nats-url", d.url,
		"--nats-nkey", filepath.Join(secrets, "admin.nk"), "--nats-ca", filepath.Join(secrets, deploykeys.CACert),
		"--agent", "local/t1", "--agent", "local/t2")
	if out, err := boot.CombinedOutput(); err != nil {
		t.Fatalf("planner bootstrap as admin: %v\n%s", err, out)
	}
	// Without admin rights the bootstrap is refused.
	boot = exec.Command(filepath.Join(binDir, "planner"), "bootstrap", "--nats-url", d.url,
		"--nats-nkey", filepath.Join(secrets, "health.nk"), "--nats-ca", filepath.Join(secrets, deploykeys.CACert),
		"--nats-inbox-prefix", "_INBOX_health")
	if out, err := boot.CombinedOutput(); err == nil {
		t.Fatalf("planner bootstrap as health succeeded:\n%s", out)
	}

	admin := d.connect(t, ctx, "admin", "_INBOX_admin")
	operator := d.connect(t, ctx, "operator", "_INBOX_operator")
	stateDir, err := os.MkdirTemp("", "proxyfleet-deploy-state-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	f := &fleet{t: t, conn: operator, api: api.NewClient(operator.NC, api.WithTimeout(5*time.Second)), dir: t.TempDir(), stateDir: stateDir, procs: map[string]*exec.Cmd{}}
	t.Cleanup(func() {
		for _, n := range []string{"gateway", "local-agent", "health", "planner"} {
			f.stop(n)
		}
	})
	f.dumpLogsOnFailure()
	t.Cleanup(func() {
		if t.Failed() {
			l := f.log("gateway")
			if len(l) > 6000 {
				l = l[len(l)-6000:]
			}
			t.Logf("---- gateway log (tail) ----\n%s", l)
		}
	})
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(d.log)
			t.Logf("---- nats-server log ----\n%s", b)
		}
	})

	// Each service as its unit starts it; the extra flags tune timing and
	// ports for a test and carry no NATS or credential flag.
	vars := map[string]string{"NATS_URL": d.url, "METRICS_PORT": "0", "AGENT_TARGET": "t1", "GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_NAME": "gw-1"}
	creds := map[string]string{"local-agent.nk": "agent-local-t1.nk", "gateway.nk": deploykeys.GatewayIdentity("gw-1") + ".nk"}
	// The gateway's clients file: crawler "dep" (the pool's name) with its
	// own password, as `htpasswd -B` writes it.
	const clientPassword = "deploy-client-password"
	clientLine, err := htpasswd.Line("dep", clientPassword)
	if err != nil {
		t.Fatal(err)
	}
	clientsFile := filepath.Join(t.TempDir(), "gateway-clients")
	if err := os.WriteFile(clientsFile, []byte(clientLine), 0o600); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"/etc/proxyfleet/gateway-clients": clientsFile}
	d.startUnit(f, "planner", secrets, vars, creds, files, "--reconcile-interval", "200ms")
	d.startUnit(f, "health", secrets, vars, creds, files, "--echo-addr", "127.0.0.1:0", "--probe-interval", "300ms", "--probe-timeout", "2s")
	// The proxies may reach health's echo endpoint and the test's origin,
	// both on loopback, which the egress policy refuses otherwise.
	org := origin(t)
	d.startUnit(f, "local-agent", secrets, vars, creds, files, "--state-dir", stateDir, "--ports", "0", "--capacity", "10",
		"--egress-allow", f.echoEndpoint(), "--egress-allow", org.Listener.Addr().String())
	f.waitAgent("local", "t1")
	d.startUnit(f, "gateway", secrets, vars, creds, files, "--demand-interval", "1s")
	var gatewayAddr, gatewayName string
	waitFor(t, 60*time.Second, "the gateway to serve", func() bool {
		l := f.log("gateway")
		m, n := gatewayServing.FindStringSubmatch(l), gatewayNamed.FindStringSubmatch(l)
		if m == nil || n == nil {
			return false
		}
		gatewayAddr, gatewayName = m[1], n[1]
		return true
	})
	if gatewayName != "gw-1" {
		t.Fatalf("the gateway serves as %q, want its unit's GATEWAY_NAME gw-1", gatewayName)
	}

	// A pool lifecycle through the operator identity. The proxies demand
	// a password: health probes with the one the planner sealed to it, the
	// gateway relays with the one sealed to the gateways' key.
	const proxyPassword = "deploy-proxy-password"
	f.apply(events.PoolSpec{Name: "dep", Provider: "local", Size: 2, Auth: &events.ProxyAuth{Username: "crawl", Password: proxyPassword}})
	ready := f.waitPool("dep", 2, "ready", 90*time.Second)
	readyIDs := map[string]bool{}
	for _, p := range ready {
		readyIDs[p.ID] = true
		if code, body, err := getThrough(p.Address, org.URL, url.UserPassword("crawl", proxyPassword)); err != nil || code != 200 || !strings.HasPrefix(body, "hello through") {
			t.Fatalf("GET through %s (%s): %d %q %v", p.ID, p.Address, code, body, err)
		}
	}
	d.throughGateway(t, gatewayAddr, gatewayName, org.URL, clientPassword, readyIDs, operator)
	// Health, under its permissions, keeps its replica key in fleet-health
	// (what splits the probing between replicas); the operator lists it.
	members, err := operator.JS.KeyValue(ctx, bus.BucketHealth)
	if err != nil {
		t.Fatalf("operator opens %s: %v", bus.BucketHealth, err)
	}
	if keys, err := members.Keys(ctx); err != nil || len(keys) != 1 {
		t.Fatalf("health replicas in %s: %v (%v), want the one running", bus.BucketHealth, keys, err)
	}
	f.deletePoolAndWait("dep")

	health := d.connect(t, ctx, "health", "_INBOX_health")
	agent := d.connect(t, ctx, "agent-local-t1", "_INBOX_agent-local-t1")
	planner := d.connect(t, ctx, "planner", "_INBOX_planner")
	gateway := d.connect(t, ctx, deploykeys.GatewayIdentity("gw-1"), deploykeys.GatewayInbox("gw-1"))

	// The services ran the lifecycle without one permission violation: a
	// subject a service needs and lacks shows here, even where the
	// service only logs a warning and carries on.
	for _, svc := range []string{"planner", "health", "local-agent", "gateway"} {
		b, _ := os.ReadFile(d.log)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "Violation") && strings.Contains(l, `:proxyfleet-`+svc+`"`) {
				t.Errorf("%s was refused a subject in normal operation: %s", svc, l)
			}
		}
	}

	// Only admin changes the topology.
	for name, c := range map[string]*bus.Conn{"health": health, "operator": operator, "agent-local-t1": agent, "planner": planner, "gateway": gateway} {
		d.refused(t, name+" creates a stream", "$JS.API.STREAM.CREATE.EVIL", func(ctx context.Context) error {
			_, err := c.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "EVIL", Subjects: []string{"evil.>"}})
			return err
		})
		d.refused(t, name+" deletes a stream", "$JS.API.STREAM.DELETE."+bus.EventsStream, func(ctx context.Context) error {
			return c.JS.DeleteStream(ctx, bus.EventsStream)
		})
		d.refused(t, name+" creates a bucket", "$JS.API.STREAM.CREATE.KV_evil", func(ctx context.Context) error {
			_, err := c.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "evil"})
			return err
		})
		d.refused(t, name+" deletes a bucket", "$JS.API.STREAM.DELETE.KV_"+bus.BucketProxies, func(ctx context.Context) error {
			return c.JS.DeleteKeyValue(ctx, bus.BucketProxies)
		})
		d.refused(t, name+" deletes health's consumer", "$JS.API.CONSUMER.DELETE."+bus.EventsStream+"."+bus.HealthProjection, func(ctx context.Context) error {
			return c.JS.DeleteConsumer(ctx, bus.EventsStream, bus.HealthProjection)
		})
		d.refused(t, name+" deletes an agent's consumer", "$JS.API.CONSUMER.DELETE."+bus.CommandsStream+".agent-local-t1", func(ctx context.Context) error {
			return c.JS.DeleteConsumer(ctx, bus.CommandsStream, "agent-local-t1")
		})
	}
	for _, s := range []string{bus.EventsStream, bus.CommandsStream, "KV_" + bus.BucketProxies} {
		if _, err := admin.JS.Stream(ctx, s); err != nil {
			t.Fatalf("stream %s is gone: %v", s, err)
		}
	}
	for _, s := range []struct{ stream, cons string }{{bus.EventsStream, bus.HealthProjection}, {bus.CommandsStream, "agent-local-t1"}} {
		if _, err := admin.JS.Consumer(ctx, s.stream, s.cons); err != nil {
			t.Fatalf("consumer %s is gone: %v", s.cons, err)
		}
	}

	// Nobody but the planner reads fleet-secrets.
	adminSecrets, err := admin.JS.KeyValue(ctx, bus.BucketSecrets)
	if err != nil {
		t.Fatal(err)
	}
	const secret = "deploy-test-secret-value"
	if _, err := adminSecrets.Put(ctx, "probe.dep", []byte(secret)); err != nil {
		t.Fatal(err)
	}
	plannerSecrets, err := planner.JS.KeyValue(ctx, bus.BucketSecrets)
	if err != nil {
		t.Fatalf("the planner cannot open fleet-secrets: %v", err)
	}
	if e, err := plannerSecrets.Get(ctx, "probe.dep"); err != nil || string(e.Value()) != secret {
		t.Fatalf("the planner cannot read fleet-secrets: %v", err)
	}
	for name, c := range map[string]*bus.Conn{"health": health, "operator": operator, "agent-local-t1": agent, "gateway": gateway} {
		d.secretRefused(t, name, c, secret)
	}
	d.operatorCLI(t, secret)

	// An agent records observations only for its own entry and target.
	for _, subj := range []string{"fleet.evt.proxy.dep-forged.running.local.t2", "fleet.evt.proxy.dep-forged.running"} {
		d.refused(t, "agent-local-t1 publishes "+subj, subj, func(ctx context.Context) error {
			_, err := agent.JS.Publish(ctx, subj, []byte(`{}`))
			return err
		})
	}
	if n := countSubject(t, admin, "fleet.evt.proxy.dep-forged.>"); n != 0 {
		t.Fatalf("%d forged events reached FLEET_EVENTS", n)
	}

	// An agent binds only its own command consumer.
	d.refused(t, "agent-local-t1 binds agent-local-t2", "$JS.API.CONSUMER.INFO.FLEET_CMDS.agent-local-t2", func(ctx context.Context) error {
		_, err := agent.JS.Consumer(ctx, bus.CommandsStream, "agent-local-t2")
		return err
	})
	d.refused(t, "agent-local-t1 pulls agent-local-t2", "$JS.API.CONSUMER.MSG.NEXT.FLEET_CMDS.agent-local-t2", func(ctx context.Context) error {
		_, err := agent.NC.Request("$JS.API.CONSUMER.MSG.NEXT.FLEET_CMDS.agent-local-t2", []byte(`{"batch":1,"expires":500000000}`), 2*time.Second)
		return err
	})
	d.refused(t, "agent-local-t1 creates a consumer on local/t2's commands", "$JS.API.CONSUMER.CREATE.FLEET_CMDS.spy.fleet.cmd.local.t2.>", func(ctx context.Context) error {
		_, err := agent.JS.CreateConsumer(ctx, bus.CommandsStream, jetstream.ConsumerConfig{Name: "spy", FilterSubject: "fleet.cmd.local.t2.>"})
		return err
	})
	d.refused(t, "agent-local-t1 widens its own consumer", "$JS.API.CONSUMER.CREATE.FLEET_CMDS.agent-local-t1.fleet.cmd.>", func(ctx context.Context) error {
		_, err := agent.JS.CreateOrUpdateConsumer(ctx, bus.CommandsStream, jetstream.ConsumerConfig{Durable: "agent-local-t1", FilterSubject: "fleet.cmd.>", AckPolicy: jetstream.AckExplicitPolicy})
		return err
	})
	if info, err := admin.JS.Consumer(ctx, bus.CommandsStream, "agent-local-t1"); err != nil || info.CachedInfo().Config.FilterSubject != "fleet.cmd.local.t1.>" {
		t.Fatalf("agent-local-t1's consumer changed: %v", err)
	}
	// Nor read another identity's replies.
	d.refused(t, "agent-local-t1 subscribes to the planner's inbox", "_INBOX_planner.>", func(ctx context.Context) error {
		return subscribeErr(agent, "_INBOX_planner.>")
	})
	d.refused(t, "operator subscribes to the default inbox", "_INBOX.>", func(ctx context.Context) error {
		return subscribeErr(operator, "_INBOX.>")
	})

	// An agent writes only its own keys.
	for _, subj := range []string{"$KV.fleet-vmids.pve.100", "$KV.fleet-agents.local.t2"} {
		d.refused(t, "agent-local-t1 writes "+subj, subj, func(ctx context.Context) error {
			_, err := agent.JS.Publish(ctx, subj, []byte(`x`))
			return err
		})
	}
	if n := countSubject(t, admin, "$KV.fleet-agents.local.t2"); n != 0 {
		t.Fatal("agent-local-t1 wrote local/t2's heartbeat")
	}
	if n := countSubject(t, admin, "$KV.fleet-vmids.>"); n != 0 {
		t.Fatal("agent-local-t1 wrote a VMID reservation")
	}

	d.gatewayRefusals(t, admin, gateway, operator)
	d.otherGatewayRefused(t, ctx, admin, gateway, operator)
}

// otherGatewayRefused: gateway gw-1 (the running one's identity) may not
// write gw-2's demand keys or request log, serve gw-2's endpoints or read
// its replies, while its own still work; the gateways' shared state (CA,
// cooldowns, sessions) is theirs to read and write, and the operator reads
// the CA's certificate, never its key, and the request log.
func (d *deployServer) otherGatewayRefused(t *testing.T, ctx context.Context, admin, gw1, operator *bus.Conn) {
	t.Helper()
	ensureGatewayBuckets(t, ctx, admin)
	for _, subj := range []string{"$KV." + bus.BucketDemand + "." + events.DemandKey("dep", "gw-2"), events.GatewayLogSubject("gw-2")} {
		d.refused(t, "gw-1 publishes "+subj, subj, func(ctx context.Context) error {
			_, err := gw1.JS.Publish(ctx, subj, []byte(`{}`))
			return err
		})
	}
	if n := countSubject(t, admin, "$KV."+bus.BucketDemand+"."+events.DemandKey("*", "gw-2")); n != 0 {
		t.Fatalf("gw-1's refused write reached gw-2's demand (%d messages)", n)
	}
	for _, subj := range []string{
		events.GatewaySubject("gw-2", events.GatewayInfo), events.GatewaySubject("gw-2", events.GatewayStats),
		events.GatewaySubject("gw-2", events.GatewayCA), deploykeys.GatewayInbox("gw-2") + ".>",
	} {
		d.refused(t, "gw-1 subscribes to "+subj, subj, func(ctx context.Context) error { return subscribeErr(gw1, subj) })
	}
	// Its own still pass.
	demand, err := gw1.JS.KeyValue(ctx, bus.BucketDemand)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := demand.Put(ctx, events.DemandKey("own", "gw-1"), []byte(`{}`)); err != nil {
		t.Fatalf("gw-1 writes its own demand: %v", err)
	}
	if _, err := gw1.JS.Publish(ctx, events.GatewayLogSubject("gw-1"), []byte(`{"gateway":"gw-1"}`)); err != nil {
		t.Fatalf("gw-1 publishes its own request log: %v", err)
	}
	if err := subscribeErr(gw1, events.GatewaySubject("gw-1", events.GatewayCA)); err != nil {
		t.Fatalf("gw-1 may not serve its own ca endpoint: %v", err)
	}
	ca, err := gw1.JS.KeyValue(ctx, deploykeys.BucketGatewayCA)
	if err != nil {
		t.Fatal(err)
	}
	// The running gateway (gw-1) created the fleet's CA at its start: it
	// reads both keys, and may create them (the server answers that they
	// exist, not a permission violation).
	waitFor(t, 30*time.Second, "the gateway to create the fleet's CA", func() bool {
		_, err := ca.Get(ctx, "cert")
		return err == nil
	})
	caVals := map[string]string{}
	for _, k := range []string{"cert", "key"} {
		e, err := ca.Get(ctx, k)
		if err != nil || len(e.Value()) == 0 {
			t.Fatalf("gw-1 reads the CA's %s: %v", k, err)
		}
		caVals[k] = string(e.Value())
		if _, err := ca.Create(ctx, k, []byte("x")); !errors.Is(err, jetstream.ErrKeyExists) {
			t.Fatalf("gw-1 creates the CA's %s again: %v, want the key to exist", k, err)
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
	}
	caStream := "KV_" + deploykeys.BucketGatewayCA
	caKeySubj := "$KV." + deploykeys.BucketGatewayCA + ".key"
	d.refused(t, "operator direct-gets the CA key", "$JS.API.DIRECT.GET."+caStream+"."+caKeySubj, func(ctx context.Context) error {
		_, err := operator.NC.RequestWithContext(ctx, "$JS.API.DIRECT.GET."+caStream+"."+caKeySubj, nil)
		return err
	})
	d.refused(t, "operator gets a CA message", "$JS.API.STREAM.MSG.GET."+caStream, func(ctx context.Context) error {
		_, err := operator.NC.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+caStream, []byte(`{"last_by_subj":"`+caKeySubj+`"}`))
		return err
	})

	// The operator with the nats CLI: the CA's certificate, not its key;
	// cooldowns; the request log, stored and live.
	out, err := d.cli(t, "kv", "get", deploykeys.BucketGatewayCA, "cert", "--raw")
	if err != nil || !strings.Contains(out, "BEGIN CERTIFICATE") {
		t.Fatalf("operator CLI: nats kv get %s cert: %v\n%s", deploykeys.BucketGatewayCA, err, out)
	}
	if out, err := d.cli(t, "kv", "get", deploykeys.BucketGatewayCA, "key", "--raw"); err == nil || strings.Contains(out, caVals["key"]) {
		t.Fatalf("operator CLI read the gateways' CA key: %v\n%s", err, out)
	}
	if out, err := d.cli(t, "kv", "get", deploykeys.BucketGatewayCooldowns, "example_com.p1", "--raw"); err != nil || !strings.Contains(out, "x") {
		t.Fatalf("operator CLI: nats kv get %s: %v\n%s", deploykeys.BucketGatewayCooldowns, err, out)
	}
	// The running gateway recorded the crawler's requests (nats stream
	// view pages interactively only, so the test gets messages).
	if out, err := d.cli(t, "stream", "get", bus.RequestLogStream, "1"); err != nil || !strings.Contains(out, `"gateway":"gw-1"`) || !strings.Contains(out, `"pool":"dep"`) {
		t.Fatalf("operator CLI: nats stream get %s 1: %v; want the gateway's record of a request to pool dep\n%s", bus.RequestLogStream, err, out)
	}
	if out, err := d.cli(t, "stream", "get", bus.RequestLogStream, "-S", events.GatewayLogSubject("gw-1")); err != nil || !strings.Contains(out, `{"gateway":"gw-1"}`) {
		t.Fatalf("operator CLI: nats stream get %s -S %s: %v\n%s", bus.RequestLogStream, events.GatewayLogSubject("gw-1"), err, out)
	}
	if err := subscribeErr(operator, events.GatewayLogAll); err != nil {
		t.Fatalf("the operator may not follow the request log: %v", err)
	}
}

// throughGateway is a crawler's view of the gateway at addr under its
// shipped identity: with the clients file's password, a GET of target goes
// through one of the pool's ready proxies (the gateway opened the pool's
// sealed proxy password), with a wrong one the gateway answers 407. The
// operator then reads the gateway's info and its demand in fleet-demand.
func (d *deployServer) throughGateway(t *testing.T, addr, name, target, password string, ready map[string]bool, operator *bus.Conn) {
	t.Helper()
	client := func(pw string) *http.Client {
		tr := &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: addr, User: url.UserPassword("dep", pw)}), DisableKeepAlives: true}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr, Timeout: 10 * time.Second}
	}
	good := client(password)
	var code int
	var body, via string
	var err error
	// The planner seals the pool's password once the gateway announced
	// its key and the pool exists; until the gateway holds it, it answers
	// with an error.
	waitFor(t, 60*time.Second, "a GET through the gateway", func() bool {
		code, body, via, err = viaGateway(good, target)
		return err == nil && code == 200
	})
	for range 4 {
		code, body, via, err = viaGateway(good, target)
		if err != nil || code != 200 || !strings.HasPrefix(body, "hello through") || !ready[via] {
			t.Fatalf("GET through the gateway: %d %q via %q (%v); want 200 through one of %v", code, body, via, err, ready)
		}
	}
	if code, _, _, err := viaGateway(client("wrong-password"), target); err != nil || code != http.StatusProxyAuthRequired {
		t.Fatalf("GET through the gateway with a wrong client password: %d %v, want 407", code, err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msg, err := operator.NC.RequestWithContext(ctx, events.GatewaySubject(name, events.GatewayInfo), nil)
	if err != nil {
		t.Fatalf("operator asks the gateway's info: %v", err)
	}
	var info struct {
		Pools map[string]struct {
			Ready       []string `json:"ready"`
			Credentials string   `json:"credentials"`
		} `json:"pools"`
	}
	if err := json.Unmarshal(msg.Data, &info); err != nil || info.Pools["dep"].Credentials != "ok" || len(info.Pools["dep"].Ready) != len(ready) {
		t.Fatalf("the gateway's info: %s (%v); want pool dep with its %d ready proxies and credentials ok", msg.Data, err, len(ready))
	}
	if _, err := operator.NC.RequestWithContext(ctx, events.GatewaySubject(name, events.GatewayStats), nil); err != nil {
		t.Fatalf("operator asks the gateway's stats: %v", err)
	}
	demand, err := operator.JS.KeyValue(ctx, bus.BucketDemand)
	if err != nil {
		t.Fatalf("operator opens %s: %v", bus.BucketDemand, err)
	}
	waitFor(t, 10*time.Second, "the gateway's demand for pool dep", func() bool {
		_, err := demand.Get(ctx, events.DemandKey("dep", name))
		return err == nil
	})
}

// gatewayRefusals: the gateway's identity writes only its key in
// fleet-gateway-creds and its demand, appends no event, and its two core
// NATS messages (a suspect proxy for health, a ban report for the
// planner) get through; the operator does not read the sealed passwords.
func (d *deployServer) gatewayRefusals(t *testing.T, admin, gateway, operator *bus.Conn) {
	t.Helper()
	for _, subj := range []string{"$KV.fleet-gateway-creds.dep", "$KV.fleet-proxies.dep-forged", "fleet.evt.proxy.dep-forged.ready"} {
		before := countSubject(t, admin, subj) // the planner sealed and removed dep's password
		d.refused(t, "gateway publishes "+subj, subj, func(ctx context.Context) error {
			_, err := gateway.JS.Publish(ctx, subj, []byte(`{}`))
			return err
		})
		if n := countSubject(t, admin, subj); n != before {
			t.Fatalf("the gateway's refused publish reached %s (%d messages, %d before)", subj, n, before)
		}
	}
	d.refused(t, "gateway reads the event log", "$JS.API.DIRECT.GET."+bus.EventsStream, func(ctx context.Context) error {
		_, err := gateway.NC.RequestWithContext(ctx, "$JS.API.DIRECT.GET."+bus.EventsStream, []byte(`{"seq":1}`))
		return err
	})
	creds := "KV_" + bus.BucketGatewayCreds
	d.refused(t, "operator direct-gets a sealed gateway password", "$JS.API.DIRECT.GET."+creds+".$KV."+bus.BucketGatewayCreds+".dep", func(ctx context.Context) error {
		_, err := operator.NC.RequestWithContext(ctx, "$JS.API.DIRECT.GET."+creds+".$KV."+bus.BucketGatewayCreds+".dep", nil)
		return err
	})

	sub, err := admin.NC.SubscribeSync(events.SuspectSubject)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := admin.NC.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := gateway.NC.Publish(events.SuspectSubject, []byte(`{"id":"dep-none","reason":"deploy test"}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.NextMsg(5 * time.Second); err != nil {
		t.Fatalf("the gateway's suspect report did not reach %s: %v", events.SuspectSubject, err)
	}
	_, err = api.NewClient(gateway.NC, api.WithTimeout(10*time.Second)).ReportBan(context.Background(), api.ProxyBanRequest{ID: "dep-none", Reason: "deploy test"})
	if errors.Is(err, api.ErrNoReply) {
		t.Fatalf("the gateway's ban report got no answer from the planner: %v", err)
	}
	// The planner's answer, not a permission error: the proxy is unknown.
	if !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("ban report of an unknown proxy: got %#v, want the planner's not_found", err)
	}
}

// deployServer is a nats-server started from the shipped deploy/nats.
type deployServer struct {
	url string // tls://127.0.0.1:<port>
	log string // the server's log file
	ca  string
	dir string // the generated secrets
}

func startDeployServer(t *testing.T, bin, secrets string) *deployServer {
	t.Helper()
	// The shipped nats-server.conf and permissions.conf as they are, with
	// the accounts.conf deploy-secrets wrote for these identities.
	run := t.TempDir()
	confDir := filepath.Join(run, "conf")
	if err := os.Mkdir(confDir, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{filepath.Join("..", "deploy", "nats", "nats-server.conf"), filepath.Join("..", "deploy", "nats", "permissions.conf"), filepath.Join(secrets, deploykeys.AccountsFile)} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(confDir, filepath.Base(f)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	conf := filepath.Join(confDir, "nats-server.conf")
	env := os.Environ()
	b, err := os.ReadFile(filepath.Join(secrets, deploykeys.EnvFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if l != "" && !strings.HasPrefix(l, "#") {
			env = append(env, l)
		}
	}
	env = append(env,
		"SERVER_NAME=pf-deploy-test",
		// Port -1: the kernel chooses; the server writes it to its ports file.
		"NATS_LISTEN=127.0.0.1:-1", "NATS_MONITOR=127.0.0.1:-1",
		"NATS_STORE_DIR="+filepath.Join(run, "jetstream"),
		"NATS_TLS_CERT="+filepath.Join(secrets, deploykeys.ServerCert),
		"NATS_TLS_KEY="+filepath.Join(secrets, deploykeys.ServerKey),
		"NATS_TLS_CA="+filepath.Join(secrets, deploykeys.CACert),
	)
	check := exec.Command(bin, "-t", "-c", conf)
	check.Env = env
	if out, err := check.CombinedOutput(); err != nil {
		t.Fatalf("nats-server -t rejects the shipped deploy/nats: %v\n%s", err, out)
	}
	d := &deployServer{log: filepath.Join(run, "nats-server.log"), ca: filepath.Join(secrets, deploykeys.CACert), dir: secrets}
	cmd := exec.Command(bin, "-c", conf, "--ports_file_dir", run, "-l", d.log)
	cmd.Env = env
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		testwait.Stop(cmd, syscall.SIGTERM, 10*time.Second)
	})
	portsFile := filepath.Join(run, fmt.Sprintf("%s_%d.ports", filepath.Base(bin), cmd.Process.Pid))
	var ports struct {
		Nats []string `json:"nats"`
	}
	waitFor(t, 20*time.Second, "the nats-server ports file", func() bool {
		b, err := os.ReadFile(portsFile)
		return err == nil && json.Unmarshal(b, &ports) == nil && len(ports.Nats) > 0
	})
	u := ports.Nats[0]
	if !strings.HasPrefix(u, "tls://") {
		t.Fatalf("the shipped server does not require TLS: it announces %s", u)
	}
	d.url = u
	return d
}

// connect opens a connection as identity over TLS, as a service would with
// --ensure-topology=false.
func (d *deployServer) connect(t *testing.T, ctx context.Context, identity, inbox string) *bus.Conn {
	t.Helper()
	c, err := bus.Connect(ctx, bus.Config{URL: d.url, NKeyFile: filepath.Join(d.dir, identity+".nk"), CAFile: d.ca,
		InboxPrefix: inbox, Name: "deploy-test-" + identity, Replicas: 1, NoCreate: true}, nil)
	if err != nil {
		t.Fatalf("connect as %s: %v", identity, err)
	}
	t.Cleanup(c.Close)
	return c
}

// startUnit starts service as deploy/systemd/<service>.service does: its
// ExecStart with ${VARS} from vars, %d a credentials directory holding each
// LoadCredential= file (copied from the generated secrets; creds maps a
// unit's source file name to the generated one where they differ), each
// path the unit names that files maps replaced by the test's file, the
// binary built for the test and the state directory under the test's.
func (d *deployServer) startUnit(f *fleet, service, secrets string, vars, creds, files map[string]string, extra ...string) {
	t := f.t
	t.Helper()
	for _, a := range extra {
		if strings.HasPrefix(a, "--nats") || strings.HasPrefix(a, "--ensure") {
			t.Fatalf("test flag %s would override the unit's NATS settings", a)
		}
	}
	unit, err := os.ReadFile(filepath.Join("..", "deploy", "systemd", service+".service"))
	if err != nil {
		t.Fatal(err)
	}
	credDir := t.TempDir()
	var execLine []string
	sc := bufio.NewScanner(strings.NewReader(string(unit)))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "LoadCredential="):
			id, src, ok := strings.Cut(strings.TrimPrefix(line, "LoadCredential="), ":")
			if !ok {
				t.Fatalf("%s: LoadCredential= without a source path: %s", service, line)
			}
			name := filepath.Base(src)
			if m, ok := creds[name]; ok {
				name = m
			}
			b, err := os.ReadFile(filepath.Join(secrets, name))
			if err != nil {
				t.Fatalf("%s: LoadCredential=%s:%s: make deploy-secrets writes no %s: %v", service, id, src, name, err)
			}
			if err := os.WriteFile(filepath.Join(credDir, id), b, 0o400); err != nil {
				t.Fatal(err)
			}
		case strings.HasPrefix(line, "ExecStart="):
			execLine = strings.Fields(strings.TrimPrefix(line, "ExecStart="))
		}
	}
	if len(execLine) == 0 {
		t.Fatalf("%s.service has no ExecStart", service)
	}
	varRE := regexp.MustCompile(`\$\{([A-Z_]+)\}`)
	args := make([]string, 0, len(execLine))
	for i, a := range execLine[1:] {
		a = strings.ReplaceAll(a, "%d", credDir)
		a = varRE.ReplaceAllStringFunc(a, func(m string) string {
			v, ok := vars[varRE.FindStringSubmatch(m)[1]]
			if !ok {
				t.Fatalf("%s.service uses %s, which the test does not know", service, m)
			}
			return v
		})
		if execLine[i] == "--data-dir" { // execLine[i] is the previous argument
			a = filepath.Join(f.dir, service)
		}
		if p, ok := files[a]; ok {
			a = p
		}
		args = append(args, a)
	}
	for _, a := range args {
		if strings.Contains(a, "%") {
			t.Fatalf("%s.service: unknown specifier in %q", service, a)
		}
	}
	if filepath.Base(execLine[0]) != service {
		t.Fatalf("%s.service starts %s", service, execLine[0])
	}
	f.startBinaryArgs(service, filepath.Join(binDir, service), nil, append(append(args, extra...), "--log-level", "debug"))
}

// refused runs do, which must fail, and checks that the server logged a
// permission violation for subject: the refusal came from the
// permissions, not from something else.
func (d *deployServer) refused(t *testing.T, what, subject string, do func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := do(ctx); err == nil {
		t.Fatalf("%s: allowed, want refused", what)
	}
	want := fmt.Sprintf("Subject %q", subject)
	deadline := time.Now().Add(3 * time.Second)
	for {
		b, _ := os.ReadFile(d.log)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "Violation") && strings.Contains(l, want) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: failed, but the server logged no permission violation for %s", what, subject)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// secretRefused checks that identity c cannot read fleet-secrets in any of
// the ways JetStream offers, nor see its values being written.
func (d *deployServer) secretRefused(t *testing.T, name string, c *bus.Conn, secret string) {
	t.Helper()
	key := "$KV." + bus.BucketSecrets + ".probe.dep"
	stream := "KV_" + bus.BucketSecrets
	d.refused(t, name+" direct-gets a secret", "$JS.API.DIRECT.GET."+stream+"."+key, func(ctx context.Context) error {
		m, err := c.NC.RequestWithContext(ctx, "$JS.API.DIRECT.GET."+stream+"."+key, nil)
		if err == nil && strings.Contains(string(m.Data), secret) {
			t.Fatalf("%s read a secret by direct get", name)
		}
		return err
	})
	d.refused(t, name+" gets a secret message", "$JS.API.STREAM.MSG.GET."+stream, func(ctx context.Context) error {
		m, err := c.NC.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, []byte(`{"last_by_subj":"`+key+`"}`))
		if err == nil && strings.Contains(string(m.Data), secret) {
			t.Fatalf("%s read a secret by message get", name)
		}
		return err
	})
	d.refused(t, name+" creates a consumer on "+stream, "$JS.API.CONSUMER.CREATE."+stream+".spy."+key, func(ctx context.Context) error {
		_, err := c.JS.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{Name: "spy", FilterSubject: key})
		return err
	})
	kvErr := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		kv, err := c.JS.KeyValue(ctx, bus.BucketSecrets)
		if err != nil {
			return err
		}
		e, err := kv.Get(ctx, "probe.dep")
		if err == nil && strings.Contains(string(e.Value()), secret) {
			t.Fatalf("%s read a secret through the KV API", name)
		}
		return err
	}()
	if kvErr == nil {
		t.Fatalf("%s: KV get of fleet-secrets allowed", name)
	}
	if err := subscribeErr(c, key); err == nil {
		t.Fatalf("%s may subscribe to %s", name, key)
	}
}

// operatorCLI uses the nats CLI as an operator would, with the operator's
// nkey and inbox prefix: the API and the views answer; the secrets and the
// topology do not.
func (d *deployServer) operatorCLI(t *testing.T, secret string) {
	t.Helper()
	run := func(args ...string) (string, error) { return d.cli(t, args...) }
	if out, err := run("req", "fleet.api.pool.list", "{}"); err != nil || !strings.Contains(out, "pools") {
		t.Fatalf("operator CLI: nats req fleet.api.pool.list: %v\n%s", err, out)
	}
	if out, err := run("kv", "ls", bus.BucketAgents); err != nil || !strings.Contains(out, "local.t1") {
		t.Fatalf("operator CLI: nats kv ls %s: %v\n%s", bus.BucketAgents, err, out)
	}
	if out, err := run("kv", "get", bus.BucketSecrets, "probe.dep", "--raw"); err == nil || strings.Contains(out, secret) {
		t.Fatalf("operator CLI read fleet-secrets: %v\n%s", err, out)
	}
	if out, err := run("stream", "rm", bus.EventsStream, "-f"); err == nil {
		t.Fatalf("operator CLI removed %s:\n%s", bus.EventsStream, out)
	}
}

// cli runs the nats CLI as an operator would, with the operator's nkey
// and inbox prefix.
func (d *deployServer) cli(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cli := os.Getenv("PROXYFLEET_NATS_CLI")
	if cli == "" {
		cli, _ = exec.LookPath("nats")
	}
	testgate.Need(t, cli != "", "no nats CLI: make test-deploy links the pinned one and sets PROXYFLEET_NATS_CLI")
	home := t.TempDir() // no saved context of the machine's user applies
	cmd := exec.Command(cli, append([]string{"--server", d.url, "--nkey", filepath.Join(d.dir, "operator.nk"),
		"--tlsca", d.ca, "--inbox-prefix", "_INBOX_operator", "--timeout", "2s"}, args...)...)
	cmd.Env = append(os.Environ(), "HOME="+home, "XDG_CONFIG_HOME="+home)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// subscribeErr subscribes to subject and reports the server's refusal.
func subscribeErr(c *bus.Conn, subject string) error {
	errs := make(chan error, 1)
	c.NC.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case errs <- err:
			default:
			}
		}
	})
	defer c.NC.SetErrorHandler(nil)
	sub, err := c.NC.SubscribeSync(subject)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = c.NC.Flush()
	select {
	case err := <-errs:
		return err
	case <-time.After(2 * time.Second):
		return nil
	}
}

// countSubject counts messages on subjects matching filter in the stream
// holding them, as admin.
func countSubject(t *testing.T, admin *bus.Conn, filter string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stream := bus.EventsStream
	if strings.HasPrefix(filter, "$KV.") {
		stream = "KV_" + strings.Split(filter, ".")[1]
	}
	s, err := admin.JS.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n
}
