//go:build restore

package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// The passwords of the test server's admin and backup users, whose
// permissions are deploy/nats's ADMIN_PERMS (the identity that restores)
// and BACKUP_PERMS (the one that backs up).
const (
	restoreAdminPassword  = "restore-test-admin"
	restoreBackupPassword = "restore-test-backup"
)

// permSet finds the permission sets of deploy/nats/permissions.conf.
var permSet = regexp.MustCompile(`(?m)^([A-Z0-9_]+_PERMS) =`)

// gatewayCALoaded finds the expiry of the gateway CA a gateway loaded.
var gatewayCALoaded = regexp.MustCompile(`"msg":"gateway CA loaded"[^\n]*?"not_after":"([^"]+)"`)

// natsServer is one nats-server process with a file store.
type natsServer struct {
	t     *testing.T
	cmd   *exec.Cmd
	url   string
	store string
	run   string
}

// startNATSServer starts bin with its JetStream store in store and, in
// one account FLEET, the users admin and backup with deploy/nats's
// ADMIN_PERMS and BACKUP_PERMS and the services as the unauthenticated
// user (no_auth_user).
func startNATSServer(t *testing.T, bin, store string) *natsServer {
	t.Helper()
	run := t.TempDir()
	perms, err := os.ReadFile(filepath.Join("..", "deploy", "nats", "permissions.conf"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(run, "permissions.conf"), perms, 0o600); err != nil {
		t.Fatal(err)
	}
	// The server refuses a permission set no user names: every other set
	// gets a user nobody logs in as.
	var others []string
	for _, m := range permSet.FindAllSubmatch(perms, -1) {
		if name := string(m[1]); name != "ADMIN_PERMS" && name != "BACKUP_PERMS" {
			others = append(others, fmt.Sprintf("      { user: %q, password: %q, permissions: $%s }", strings.ToLower(name), "unused-"+name, name))
		}
	}
	conf := fmt.Sprintf(`listen: "127.0.0.1:-1"
jetstream { store_dir: %q }
include ./permissions.conf
accounts {
  FLEET {
    jetstream: enabled
    users: [
      { user: admin, password: %q, permissions: $ADMIN_PERMS }
      { user: backup, password: %q, permissions: $BACKUP_PERMS }
      { user: services, password: "unused-services-password" }
%s
    ]
  }
  SYS {}
}
system_account: SYS
no_auth_user: services
`, store, restoreAdminPassword, restoreBackupPassword, strings.Join(others, "\n"))
	confPath := filepath.Join(run, "nats-server.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	ports := filepath.Join(run, "ports")
	if err := os.MkdirAll(ports, 0o700); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", confPath, "--ports_file_dir", ports, "-l", filepath.Join(run, "nats-server.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	s := &natsServer{t: t, cmd: cmd, store: store, run: run}
	t.Cleanup(func() {
		s.stop(syscall.SIGTERM)
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(run, "nats-server.log"))
			if len(b) > 3000 {
				b = b[len(b)-3000:]
			}
			t.Logf("---- nats-server log (tail) ----\n%s", b)
		}
	})
	portsFile := filepath.Join(ports, fmt.Sprintf("%s_%d.ports", filepath.Base(bin), cmd.Process.Pid))
	var p struct {
		Nats []string `json:"nats"`
	}
	waitFor(t, 30*time.Second, "nats-server's ports file", func() bool {
		b, err := os.ReadFile(portsFile)
		return err == nil && json.Unmarshal(b, &p) == nil && len(p.Nats) > 0
	})
	s.url = p.Nats[0]
	return s
}

func (s *natsServer) stop(sig syscall.Signal) {
	if s.cmd == nil {
		return
	}
	testwait.Stop(s.cmd, sig, 20*time.Second)
	s.cmd = nil
}

func (s *natsServer) connect() *bus.Conn {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := bus.Connect(ctx, bus.Config{URL: s.url, Name: "restore-test"}, nil)
	if err != nil {
		s.t.Fatalf("connect to %s: %v", s.url, err)
	}
	s.t.Cleanup(conn.Close)
	return conn
}

// recoveryPoint is scripts/backup.sh's recovery-point.json.
type recoveryPoint struct {
	Stream   string    `json:"stream"`
	LastSeq  uint64    `json:"lastSeq"`
	LastTime time.Time `json:"lastTime"`
	Streams  []string  `json:"streams"`
	Keys     string    `json:"keys"`
}

// script runs scripts/<name> against url, backup.sh as the backup
// identity (with its own inbox prefix) and restore.sh as admin.
func script(t *testing.T, cli, url, name string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join("..", "scripts", name), args...)
	identity := []string{"NATS_USER=admin", "NATS_PASSWORD=" + restoreAdminPassword}
	if name == "backup.sh" {
		identity = []string{"NATS_USER=backup", "NATS_PASSWORD=" + restoreBackupPassword, "NATS_INBOX_PREFIX=_INBOX_backup"}
	}
	cmd.Env = append(append(os.Environ(), "NATS_CLI="+cli, "NATS_URL="+url), identity...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// restoreFleet is the system on one nats-server: planner, health, a local
// agent and the gateway as processes, bound to what planner bootstrap (or
// the restore) created.
type restoreFleet struct {
	*fleet
	echo string // ip:port of the probes' echo endpoint
	gw   string // the gateway's listen address, once it serves
	gwN  int    // gateway starts, each logging to its own file
}

// svc starts bin as process name (its log name) with its data in
// <dir>/<bin>, which outlives the server as a service host's would.
func (rf *restoreFleet) svc(name, bin string, args ...string) {
	rf.t.Helper()
	common := []string{"--nats-url", rf.conn.ClientURL(), "--data-dir", filepath.Join(rf.dir, bin),
		"--ensure-topology=false", "--log-level", "debug"}
	rf.startBinaryArgs(name, filepath.Join(binDir, bin), nil, append(common, args...))
}

// startServices starts every service and waits until the gateway serves.
func (rf *restoreFleet) startServices() {
	rf.t.Helper()
	rf.svc("health", "health", "--echo-addr", "", "--echo-url", "http://"+rf.echo+"/",
		"--probe-interval", "300ms", "--probe-timeout", "2s")
	rf.svc("local-agent", "local-agent", append([]string{"--entry", "local", "--target", "t1", "--state-dir", rf.stateDir,
		"--ports", "0", "--capacity", "20"}, rf.agentArg...)...)
	rf.svc("planner", "planner", "--id", "planner-r", "--reconcile-interval", "200ms", "--gc-interval", "1s", "--gc-grace", "2s")
	rf.gwN++
	name := fmt.Sprintf("gateway-%d", rf.gwN)
	rf.svc(name, "gateway", "--listen", "127.0.0.1:0", "--demand-interval", "1s")
	waitFor(rf.t, 60*time.Second, "the gateway to serve", func() bool {
		m := gatewayServing.FindStringSubmatch(rf.log(name))
		if m == nil {
			return false
		}
		rf.gw = m[1]
		return true
	})
}

func (rf *restoreFleet) stopServices() {
	for _, n := range []string{fmt.Sprintf("gateway-%d", rf.gwN), "planner", "health", "local-agent"} {
		rf.stop(n)
	}
}

// serves reports whether one request to target through the gateway
// succeeded through a proxy.
func (rf *restoreFleet) serves(c *http.Client, target string) bool {
	code, _, via, err := viaGateway(c, target)
	return err == nil && code == http.StatusOK && via != ""
}

// instancePIDs maps each proxy of pool to the pid its instance runs as.
func (rf *restoreFleet) instancePIDs(pool string) map[string]int {
	out := map[string]int{}
	for _, p := range rf.proxies(pool) {
		out[p.ID] = rf.statePID(p.ID)
	}
	return out
}

// TestRestoreAfterLosingTheServersDisk backs up a serving fleet with
// scripts/backup.sh, changes it (one proxy more), loses the server's store,
// restores the backup into a fresh server with scripts/restore.sh and
// starts the services again: the proxies of the backup are adopted (same
// ids, same processes, no new request for them), the proxy created after
// the backup is cleaned up as an orphan, the views equal a rebuild of the
// restored log, and the gateway serves again.
func TestRestoreAfterLosingTheServersDisk(t *testing.T) {
	bin := os.Getenv("PROXYFLEET_NATS_SERVER")
	cli := os.Getenv("PROXYFLEET_NATS_CLI")
	testgate.Need(t, bin != "" && cli != "", "no nats-server or nats CLI: make test-restore builds the pinned ones and sets PROXYFLEET_NATS_SERVER and PROXYFLEET_NATS_CLI")
	testgate.NeedBinary(t, "jq", "scripts/backup.sh and restore.sh read the backup's metadata with it (apt-get install jq)")
	needBinaries(t)

	site := origin(t)
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"ip": host})
	}))
	t.Cleanup(echo.Close)

	srvA := startNATSServer(t, bin, t.TempDir())
	rf := &restoreFleet{echo: echo.Listener.Addr().String()}
	rf.fleet = &fleet{t: t, conn: srvA.connect(), dir: t.TempDir(), stateDir: t.TempDir(), procs: map[string]*exec.Cmd{},
		agentArg: []string{"--egress-allow", rf.echo, "--egress-allow", site.Listener.Addr().String()}}
	rf.api = api.NewClient(rf.conn.NC, api.WithTimeout(5*time.Second))
	t.Cleanup(func() {
		rf.mu.Lock()
		names := make([]string, 0, len(rf.procs))
		for n := range rf.procs {
			names = append(names, n)
		}
		rf.mu.Unlock()
		for _, n := range names {
			rf.stop(n)
		}
		for _, pid := range proxyProcesses(agentExe(), rf.stateDir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, n := range []string{"planner", "health", "local-agent", "gateway-1", "gateway-2"} {
			l := rf.log(n)
			if len(l) > 5000 {
				l = l[len(l)-5000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})

	// The topology as an operator creates it; the services bind it.
	bootstrap := func(url string) {
		out, err := exec.Command(filepath.Join(binDir, "planner"), "bootstrap", "--nats-url", url,
			"--data-dir", filepath.Join(rf.dir, "bootstrap"), "--agent", "local/t1").CombinedOutput()
		if err != nil {
			t.Fatalf("planner bootstrap: %v\n%s", err, out)
		}
	}
	bootstrap(srvA.url)
	rf.startServices()
	rf.apply(events.PoolSpec{Name: "bk", Provider: "local", Size: 3})
	rf.waitPool("bk", 3, "ready", 90*time.Second)
	client := gatewayClient(t, rf.gw, "bk")
	waitFor(t, 60*time.Second, "the gateway to serve through a ready proxy", func() bool { return rf.serves(client, site.URL) })
	before := rf.instancePIDs("bk")

	// The backup, taken while everything runs.
	backupDir := filepath.Join(t.TempDir(), "backup")
	keys := t.TempDir()
	if err := os.WriteFile(filepath.Join(keys, "admin.nk"), []byte("SUAEXAMPLESEEDFORTHETEST"), 0o600); err != nil {
		t.Fatal(err)
	}
	probeKey := filepath.Join(rf.dir, "health", "probe.xk")
	gatewayKey := filepath.Join(rf.dir, "gateway", "gateway.xk")
	out, err := script(t, cli, srvA.url, "backup.sh", "--keys", keys, "--keys", probeKey, "--keys", gatewayKey, backupDir)
	if err != nil {
		t.Fatalf("backup.sh: %v\n%s", err, out)
	}
	t.Logf("backup.sh:\n%s", out)
	if list, err := exec.Command("tar", "-tf", filepath.Join(backupDir, "keys.tar")).CombinedOutput(); err != nil ||
		!strings.Contains(string(list), filepath.Base(keys)+"/admin.nk") || !strings.Contains(string(list), "probe.xk") || !strings.Contains(string(list), "gateway.xk") {
		t.Errorf("keys.tar: %v; want the secrets directory, probe.xk and gateway.xk:\n%s", err, list)
	}
	var rp recoveryPoint
	if b, err := os.ReadFile(filepath.Join(backupDir, "recovery-point.json")); err != nil || json.Unmarshal(b, &rp) != nil {
		t.Fatalf("recovery-point.json: %v\n%s", err, b)
	}
	for _, s := range []string{bus.EventsStream, bus.CommandsStream, bus.RequestLogStream, "KV_" + bus.BucketProxies,
		"KV_" + bus.BucketSecrets, "KV_" + bus.BucketGatewayCreds, "OBJ_" + bus.ObjectSnapshots} {
		if !slices.Contains(rp.Streams, s) {
			t.Errorf("the backup lacks stream %s: it has %v", s, rp.Streams)
		}
	}
	if rp.LastSeq == 0 || rp.LastTime.IsZero() || rp.Keys != "keys.tar" {
		t.Fatalf("recovery point %+v: want FLEET_EVENTS' last sequence and time, and the keys", rp)
	}

	// Bad input is refused before anything is written or changed: a
	// backup into a directory that exists, a restore of a directory that
	// is not a whole backup.
	if out, err := script(t, cli, srvA.url, "backup.sh", backupDir); err == nil || !strings.Contains(out, "exists") {
		t.Errorf("backup.sh into the existing %s: %v; want a refusal\n%s", backupDir, err, out)
	}
	partial := t.TempDir()
	if out, err := script(t, cli, srvA.url, "restore.sh", partial); err == nil || !strings.Contains(out, "recovery-point.json is missing") {
		t.Errorf("restore.sh of an empty directory: %v; want a refusal naming recovery-point.json\n%s", err, out)
	}
	if out, err := script(t, cli, srvA.url, "restore.sh", "--replicas", "7", backupDir); err == nil || !strings.Contains(out, "--replicas") {
		t.Errorf("restore.sh --replicas 7: %v; want a refusal naming --replicas\n%s", err, out)
	}

	// A restore into a server that holds the streams is refused and
	// changes nothing.
	created := rf.streamCreated(bus.EventsStream)
	out, err = script(t, cli, srvA.url, "restore.sh", backupDir)
	if err == nil || !strings.Contains(out, "already holds") || !strings.Contains(out, "nothing was changed") {
		t.Fatalf("restore.sh into the running server: %v; want a refusal naming the streams it holds\n%s", err, out)
	}
	if rf.streamCreated(bus.EventsStream) != created {
		t.Fatalf("the refused restore replaced FLEET_EVENTS")
	}

	// After the backup: one proxy more.
	rf.apply(events.PoolSpec{Name: "bk", Provider: "local", Size: 4})
	rf.waitPool("bk", 4, "ready", 90*time.Second)
	var lateID string
	for _, p := range rf.proxies("bk") {
		if _, ok := before[p.ID]; !ok {
			lateID = p.ID
		}
	}
	latePID := rf.statePID(lateID)
	lastSeq := rf.lastSeq(bus.EventsStream)
	lostAt := time.Now()

	// The server's disk is lost: the services stop (their units wait for
	// a server), the server dies and its store is gone. The proxies run on.
	rf.stopServices()
	srvA.stop(syscall.SIGKILL)
	if err := os.RemoveAll(srvA.store); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now()
	srvB := startNATSServer(t, bin, t.TempDir())
	out, err = script(t, cli, srvB.url, "restore.sh", backupDir)
	if err != nil {
		t.Fatalf("restore.sh into the fresh server: %v\n%s", err, out)
	}
	t.Logf("restore.sh:\n%s", out)
	rf.conn = srvB.connect()
	rf.api = api.NewClient(rf.conn.NC, api.WithTimeout(5*time.Second))
	if got := rf.lastSeq(bus.EventsStream); got != rp.LastSeq {
		t.Fatalf("FLEET_EVENTS ends at %d after the restore, the recovery point at %d", got, rp.LastSeq)
	}
	// The durable consumers came back with their streams: the services
	// bind them (--ensure-topology=false) and would fail without them.
	for stream, name := range map[string]string{bus.EventsStream: bus.HealthProjection, bus.CommandsStream: bus.AgentConsumerName("local", "t1")} {
		if _, err := rf.conn.JS.Consumer(context.Background(), stream, name); err != nil {
			t.Fatalf("consumer %s on %s after the restore: %v", name, stream, err)
		}
	}
	rf.rebuildViews()
	rf.startServices()
	client = gatewayClient(t, rf.gw, "bk")
	waitFor(t, 90*time.Second, "the gateway to serve through a ready proxy after the restore", func() bool { return rf.serves(client, site.URL) })
	recovery := time.Since(t0)
	// The restored gateway CA, the one of before, opens with the gateway
	// host's key.
	caBefore := gatewayCALoaded.FindStringSubmatch(rf.log("gateway-1"))
	var caAfter []string
	waitFor(t, 30*time.Second, "the gateway to load the restored gateway CA", func() bool {
		caAfter = gatewayCALoaded.FindStringSubmatch(rf.log("gateway-2"))
		return caAfter != nil
	})
	if caBefore == nil || caAfter[1] != caBefore[1] {
		t.Errorf("the gateway CA after the restore (not after %s) is not the one of before (%v)", caAfter[1], caBefore)
	}

	// The proxies of the backup are adopted: the same ids ready, the same
	// processes, and no second request for any of them.
	waitFor(t, 90*time.Second, "the backup's 3 proxies ready and the late proxy's instance gone", func() bool {
		ps := rf.proxies("bk")
		if len(ps) != 3 {
			return false
		}
		for _, p := range ps {
			if _, ok := before[p.ID]; !ok || p.State != "ready" {
				return false
			}
		}
		return !processAlive(latePID)
	})
	for id, pid := range before {
		if got := rf.statePID(id); got != pid || !processAlive(pid) {
			t.Errorf("proxy %s runs as pid %d (alive %v) after the restore, %d before: it was recreated", id, got, processAlive(pid), pid)
		}
		if n := rf.eventCount("fleet.evt.proxy." + id + ".requested"); n != 1 {
			t.Errorf("proxy %s has %d requested events after the restore, want the 1 of the backup", id, n)
		}
	}
	// The proxy created after the backup was unknown to the restored log:
	// the garbage collector retired its instance as an orphan.
	if n := rf.eventCount("fleet.evt.proxy." + lateID + ".retiring"); n == 0 {
		t.Errorf("no retiring event for %s, created after the backup: its instance was not cleaned up by the garbage collector", lateID)
	}
	// Nothing leaked: the agent's proxy processes are exactly the views'.
	waitFor(t, 30*time.Second, "the agent's proxy processes to equal the views' proxies", func() bool {
		procs := rf.proxyProcs()
		if len(procs) != 3 {
			return false
		}
		want := map[int]bool{}
		for _, pid := range before {
			want[pid] = true
		}
		for _, pid := range procs {
			if !want[pid] {
				return false
			}
		}
		return true
	})

	// The views equal a rebuild of the restored log (plus what happened
	// since): quiesce, read them, rebuild, compare.
	rf.stopServices()
	views := map[string]map[string][]byte{bus.BucketProxies: rf.views(bus.BucketProxies), bus.BucketPools: rf.views(bus.BucketPools)}
	rf.rebuildViews()
	for bucket, want := range views {
		if got := rf.views(bucket); !sameViews(got, want) {
			t.Errorf("%s differs from a rebuild of the restored log:\n got %s\nwant %s", bucket, dump(got), dump(want))
		}
	}

	lost := lastSeq - rp.LastSeq
	t.Logf("restore: recovery point: FLEET_EVENTS sequence %d at %s; events lost: %d (%s of the log)",
		rp.LastSeq, rp.LastTime.Format(time.RFC3339Nano), lost, lostAt.Sub(rp.LastTime).Round(time.Millisecond))
	t.Logf("restore: recovery time (restore start to the gateway serving through a ready proxy): %s", recovery.Round(time.Millisecond))
	if lost == 0 {
		t.Errorf("no event after the recovery point: the scale-up after the backup was not lost, so the test proved nothing about it")
	}
}

// rebuildViews runs health --rebuild-views against the fleet's server.
func (rf *restoreFleet) rebuildViews() {
	rf.t.Helper()
	out, err := exec.Command(filepath.Join(binDir, "health"), "--nats-url", rf.conn.ClientURL(),
		"--data-dir", filepath.Join(rf.dir, "health-rebuild"), "--rebuild-views").CombinedOutput()
	if err != nil {
		rf.t.Fatalf("health --rebuild-views: %v\n%s", err, out)
	}
}

// streamCreated is when stream was created on the fleet's server.
func (rf *restoreFleet) streamCreated(stream string) time.Time {
	rf.t.Helper()
	s, err := rf.conn.JS.Stream(context.Background(), stream)
	if err != nil {
		rf.t.Fatal(err)
	}
	return s.CachedInfo().Created
}

func processAlive(pid int) bool {
	return syscall.Kill(pid, 0) == nil && !isZombie(pid)
}
