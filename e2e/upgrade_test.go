//go:build upgrade

package e2e_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/e2e/internal/crawlload"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// The upgrade tier (make test-upgrade, docs/upgrading.md): a fleet of the
// previous release's binaries (PROXYFLEET_PREV_BIN, built by make from the
// repository's history) on a real nats-server (PROXYFLEET_NATS_SERVER),
// upgraded to the current tree service by service.

// releaseBins are the service binaries of one version.
type releaseBins struct {
	version string
	dir     string
}

func (r releaseBins) path(svc string) string { return filepath.Join(r.dir, svc) }

// prevRelease is the previous release's binaries; the test is skipped
// without them (a failure under PROXYFLEET_REQUIRE_INTEGRATION=1).
func prevRelease(t *testing.T) releaseBins {
	t.Helper()
	dir := os.Getenv("PROXYFLEET_PREV_BIN")
	testgate.Need(t, dir != "", "no previous release: make test-upgrade builds it and sets PROXYFLEET_PREV_BIN")
	b, err := os.ReadFile(filepath.Join(dir, "RELEASE"))
	if err != nil {
		t.Fatalf("the previous release's binaries in %s: %v", dir, err)
	}
	version, _, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	return releaseBins{version: version, dir: dir}
}

// currentRelease builds the current tree's services stamped as make build
// stamps them (PROXYFLEET_VERSION, else scripts/version.sh).
func currentRelease(t *testing.T) releaseBins {
	t.Helper()
	version := os.Getenv("PROXYFLEET_VERSION")
	if version == "" {
		out, err := exec.Command(filepath.Join(repoRoot(t), "scripts", "version.sh")).Output()
		if err != nil {
			t.Fatalf("scripts/version.sh: %v", err)
		}
		version = strings.TrimSpace(string(out))
	}
	dir := filepath.Join(binDir, "current")
	for _, svc := range []string{"planner", "health", "local-agent", "gateway"} {
		if err := goBuild(filepath.Join(dir, svc), "-tags", os.Getenv("PROXYFLEET_BUILD_TAGS"),
			"-ldflags", "-X proxyfleet/pkg/buildinfo.Version="+version, "proxyfleet/services/"+svc+"/cmd/"+svc); err != nil {
			t.Fatalf("build %s: %v", svc, err)
		}
		out, err := exec.Command(filepath.Join(dir, svc), "--version").Output()
		if want := svc + " " + version + "\n"; err != nil || string(out) != want {
			t.Fatalf("%s --version: %q, %v; want %q", svc, out, err, want)
		}
	}
	return releaseBins{version: version, dir: dir}
}

// startNATSServer starts one nats-server process with JetStream in a
// temporary store, its client port from the kernel, and returns its URL.
func startNATSServer(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("PROXYFLEET_NATS_SERVER")
	testgate.Need(t, bin != "", "no nats-server: make test-upgrade builds the pinned one and sets PROXYFLEET_NATS_SERVER")
	run := t.TempDir()
	conf := fmt.Sprintf("listen: \"127.0.0.1:-1\"\njetstream { store_dir: %q }\n", filepath.Join(run, "store"))
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
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	portsFile := filepath.Join(ports, fmt.Sprintf("%s_%d.ports", filepath.Base(bin), cmd.Process.Pid))
	var p struct {
		Nats []string `json:"nats"`
	}
	waitFor(t, 30*time.Second, "nats-server's ports file", func() bool {
		b, err := os.ReadFile(portsFile)
		return err == nil && json.Unmarshal(b, &p) == nil && len(p.Nats) > 0
	})
	return p.Nats[0]
}

// upgradeFleet is the system on one nats-server, each service a process
// of either release: planners planner-1 and planner-2, health, the local
// agent on target t1, gateways gw-1 and gw-2.
type upgradeFleet struct {
	*fleet
	url    string
	echo   string // ip:port of the probes' echo endpoint
	origin *httptest.Server
	bins   []string // every local-agent binary that ran, whose proxies the cleanup stops
}

func newUpgradeFleet(t *testing.T, bins ...releaseBins) *upgradeFleet {
	t.Helper()
	u := &upgradeFleet{url: startNATSServer(t)}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := bus.Connect(ctx, bus.Config{URL: u.url, Name: "upgrade-test"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Close)
	// The echo endpoint outlives health's restarts, as an external one
	// would (--echo-url); the origin is the site the client crawls.
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := strings.Cut(r.RemoteAddr, ":")
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"ip": host})
	}))
	t.Cleanup(echo.Close)
	u.echo = echo.Listener.Addr().String()
	u.origin = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(u.origin.Close)
	stateDir, err := os.MkdirTemp("", "proxyfleet-upgrade-state-")
	if err != nil {
		t.Fatal(err)
	}
	u.fleet = &fleet{t: t, conn: conn, api: api.NewClient(conn.NC, api.WithTimeout(5*time.Second)), dir: t.TempDir(),
		stateDir: stateDir, procs: map[string]*exec.Cmd{}}
	for _, b := range bins {
		u.bins = append(u.bins, b.path("local-agent"))
	}
	// The topology as the first release's operator creates it; the
	// services then update it at their start (--ensure-topology).
	boot := exec.Command(bins[0].path("planner"), "bootstrap", "--nats-url", u.url,
		"--data-dir", filepath.Join(u.dir, "bootstrap"), "--agent", "local/t1")
	if out, err := boot.CombinedOutput(); err != nil {
		t.Fatalf("planner bootstrap of %s: %v\n%s", bins[0].version, err, out)
	}
	t.Cleanup(func() {
		u.mu.Lock()
		names := make([]string, 0, len(u.procs))
		for n := range u.procs {
			names = append(names, n)
		}
		u.mu.Unlock()
		for _, n := range names {
			u.stop(n)
		}
		for _, exe := range u.bins {
			for _, pid := range proxyProcesses(exe, stateDir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		os.RemoveAll(stateDir)
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, n := range []string{"planner-1", "planner-2", "health", "local-agent", "gw-1", "gw-2"} {
			l := u.log(n)
			if len(l) > 5000 {
				l = l[len(l)-5000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})
	return u
}

func (u *upgradeFleet) startPlanner(b releaseBins, id string) {
	u.startBinary(id, b.path("planner"), nil, "--id", id, "--reconcile-interval", "300ms")
}

func (u *upgradeFleet) startHealth(b releaseBins) {
	u.startBinary("health", b.path("health"), nil, "--echo-addr", "", "--echo-url", "http://"+u.echo+"/",
		"--probe-interval", "500ms", "--probe-timeout", "3s")
}

func (u *upgradeFleet) startAgent(b releaseBins) {
	u.startBinary("local-agent", b.path("local-agent"), nil, "--entry", "local", "--target", "t1",
		"--state-dir", u.stateDir, "--ports", "0", "--capacity", "40",
		"--egress-allow", u.echo, "--egress-allow", u.origin.Listener.Addr().String())
}

// startGateway starts gateway name of release b and returns its client
// address once this start of it serves.
func (u *upgradeFleet) startGateway(b releaseBins, name string) string {
	u.t.Helper()
	before := len(gatewayServing.FindAllStringSubmatch(u.log(name), -1))
	u.startBinary(name, b.path("gateway"), nil, "--name", name, "--listen", "127.0.0.1:0", "--demand-interval", "1s")
	var addr string
	waitFor(u.t, 60*time.Second, name+" to serve", func() bool {
		m := gatewayServing.FindAllStringSubmatch(u.log(name), -1)
		if len(m) <= before {
			return false
		}
		addr = m[len(m)-1][1]
		return true
	})
	return addr
}

// serviceVersions asks every NATS micro service instance for its info
// ($SRV.INFO) and returns the versions announced, by service name.
func (u *upgradeFleet) serviceVersions() map[string][]string {
	inbox := u.conn.NC.NewRespInbox()
	sub, err := u.conn.NC.SubscribeSync(inbox)
	if err != nil {
		u.t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := u.conn.NC.PublishRequest("$SRV.INFO", inbox, nil); err != nil {
		u.t.Fatal(err)
	}
	out := map[string][]string{}
	seen := map[string]bool{}
	for {
		m, err := sub.NextMsg(time.Second)
		if err != nil {
			break
		}
		var info struct {
			Name     string            `json:"name"`
			ID       string            `json:"id"`
			Version  string            `json:"version"`
			Metadata map[string]string `json:"metadata"`
		}
		if json.Unmarshal(m.Data, &info) != nil {
			continue
		}
		// A planner replica answers once as a replica and, while it
		// leads, once more as the leader: count it once.
		key := info.Name + "/" + info.ID
		if r := info.Metadata["replica"]; r != "" {
			key = info.Name + "/replica/" + r
		}
		if !seen[key] {
			seen[key] = true
			out[info.Name] = append(out[info.Name], info.Version)
		}
	}
	for _, v := range out {
		sort.Strings(v)
	}
	return out
}

// waitVersions waits until the micro service name has exactly the
// instances of the versions want (sorted).
func (u *upgradeFleet) waitVersions(name string, want ...string) {
	u.t.Helper()
	sort.Strings(want)
	var got map[string][]string
	if testwait.For(testwait.Context(u.t, 60*time.Second), func() bool {
		got = u.serviceVersions()
		return slices.Equal(got[name], want)
	}) != nil {
		u.t.Fatalf("timed out waiting for %s instances of versions %v; the services announce %v", name, want, got)
	}
}

// proxyDecisions counts the planner's requested and retiring events on
// FLEET_EVENTS: a proxy created or retired adds one.
func (u *upgradeFleet) proxyDecisions() uint64 {
	return u.eventCount("fleet.evt.proxy.*."+events.ProxyRequested) + u.eventCount("fleet.evt.proxy.*."+events.ProxyRetiring)
}

// proxyIDs is the pool's proxy ids in the views, all ready, sorted.
func (u *upgradeFleet) readyIDs(pool string) []string {
	var ids []string
	for _, p := range u.proxies(pool) {
		if p.State != "ready" {
			u.t.Fatalf("proxy %s of pool %s is %s, want ready", p.ID, pool, p.State)
		}
		ids = append(ids, p.ID)
	}
	sort.Strings(ids)
	return ids
}

// TestUpgradeRolling: a fleet of the previous release (two planners,
// health, the local agent, two gateways) serves a pool of 3 proxies to a
// client; each service is then replaced by the current tree's, one at a
// time, with both versions running side by side for a while after each
// step. No request fails beyond its one retry, no proxy is created or
// retired (the same ids, the same processes, no requested or retiring
// event), and the views equal a rebuild from the log afterwards.
func TestUpgradeRolling(t *testing.T) {
	prev := prevRelease(t)
	cur := currentRelease(t)
	if prev.version == cur.version {
		t.Fatalf("the previous release and the current tree are both %s", cur.version)
	}
	u := newUpgradeFleet(t, prev, cur)
	hold := 8 * time.Second // mixed versions under traffic after each step

	u.startPlanner(prev, "planner-1")
	u.startPlanner(prev, "planner-2")
	u.startHealth(prev)
	u.startAgent(prev)
	u.waitAgent("local", "t1")
	u.waitLeader()
	gw1, gw2 := u.startGateway(prev, "gw-1"), u.startGateway(prev, "gw-2")
	const pool = "up"
	u.apply(events.PoolSpec{Name: pool, Provider: "local", Size: 3})
	u.waitPool(pool, 3, "ready", 90*time.Second)
	u.waitVersions("fleet-planner", prev.version, prev.version)
	u.waitVersions("fleet-agent", prev.version)
	u.waitVersions("fleet-gateway", prev.version, prev.version)

	// A client of both gateways (an upgraded gateway listens at a new
	// address, which the client follows).
	var gwAddrs [2]atomic.Value
	gwAddrs[0].Store(gw1)
	gwAddrs[1].Store(gw2)
	tr := crawlload.New(u.origin.URL+"/page", 2, func(gw int) *url.URL {
		return &url.URL{Scheme: "http", Host: gwAddrs[gw].Load().(string), User: url.UserPassword(pool, "x")}
	}, crawlload.Options{Timeout: 15 * time.Second})
	// Both gateways route before the clock starts.
	waitFor(t, 60*time.Second, "both gateways to route to the pool", func() bool {
		return tr.Once(0) == nil && tr.Once(1) == nil
	})
	ids := u.readyIDs(pool)
	pids := map[string]int{}
	for _, id := range ids {
		pids[id] = u.statePID(id)
	}
	decisions := u.proxyDecisions()
	tr.Run(2, 20*time.Millisecond)
	time.Sleep(hold)
	t0 := time.Now()
	step := func(what string) {
		t.Logf("upgrade: %s (%s after the start; %d requests so far)", what, time.Since(t0).Round(time.Millisecond), tr.Count())
	}

	// The planners one at a time: the other keeps (or takes) the lead.
	for _, id := range []string{"planner-2", "planner-1"} {
		u.stop(id)
		u.startPlanner(cur, id)
		if id == "planner-2" {
			u.waitVersions("fleet-planner", prev.version, cur.version)
		} else {
			u.waitVersions("fleet-planner", cur.version, cur.version)
		}
		step(id + " upgraded")
		time.Sleep(hold)
	}
	if _, err := u.api.PoolGet(context.Background(), pool); err != nil {
		t.Fatalf("pool.get after the planners' upgrade: %v", err)
	}
	u.stop("health")
	u.startHealth(cur)
	step("health upgraded")
	time.Sleep(hold)
	u.stop("local-agent")
	u.startAgent(cur)
	u.waitVersions("fleet-agent", cur.version)
	step("local-agent upgraded (its proxies keep running)")
	time.Sleep(hold)
	for i, name := range []string{"gw-1", "gw-2"} {
		u.stop(name)
		gwAddrs[i].Store(u.startGateway(cur, name))
		if i == 0 {
			u.waitVersions("fleet-gateway", prev.version, cur.version)
		} else {
			u.waitVersions("fleet-gateway", cur.version, cur.version)
		}
		step(name + " upgraded")
		time.Sleep(hold)
	}
	upgrade := time.Since(t0)
	// The upgraded fleet still serves and still decides.
	time.Sleep(hold)
	tr.End()

	counts, errs := tr.Between(time.Time{}, time.Time{}, 10)
	sent, retried, failed := tr.Count(), counts[crawlload.Retried], counts[crawlload.Failed]
	t.Logf("upgrade %s -> %s: %s; requests sent %d, ok after a retry %d, failed %d", prev.version, cur.version,
		upgrade.Round(time.Millisecond), sent, retried, failed)
	if failed != 0 {
		t.Errorf("%d requests failed beyond their retry during the upgrade; first: %v", failed, errs)
	}
	if sent < 200 {
		t.Errorf("only %d requests were sent during the upgrade: the traffic did not exercise it", sent)
	}
	vs := u.serviceVersions()
	for name, versions := range vs {
		for _, v := range versions {
			if v == prev.version {
				t.Errorf("%s still announces %s after the upgrade: %v", name, prev.version, vs)
			}
		}
	}
	if after := u.readyIDs(pool); !slices.Equal(after, ids) {
		t.Errorf("the pool's proxies changed during the upgrade: before %v, after %v", ids, after)
	}
	for _, id := range ids {
		if pid := u.statePID(id); pid != pids[id] || syscall.Kill(pid, 0) != nil {
			t.Errorf("proxy %s: its process %d was replaced by %d, or is gone, during the upgrade", id, pids[id], pid)
		}
	}
	if d := u.proxyDecisions(); d != decisions {
		t.Errorf("the planner created or retired %d proxies during the upgrade; want none", d-decisions)
	}
	// A scale after the upgrade is decided and carried out by the
	// upgraded fleet.
	u.apply(events.PoolSpec{Name: pool, Provider: "local", Size: 4})
	u.waitPool(pool, 4, "ready", 90*time.Second)

	u.viewsEqualRebuild(cur)
}

// viewsEqualRebuild stops every service, then requires fleet-proxies and
// fleet-pools byte-identical to what release b's health --rebuild-views
// projects from FLEET_EVENTS.
func (u *upgradeFleet) viewsEqualRebuild(b releaseBins) {
	u.t.Helper()
	for _, n := range []string{"gw-1", "gw-2", "planner-1", "planner-2", "local-agent", "health"} {
		u.stop(n)
	}
	before := map[string]map[string][]byte{
		bus.BucketProxies: u.views(bus.BucketProxies),
		bus.BucketPools:   u.views(bus.BucketPools),
	}
	cmd := exec.Command(b.path("health"), "--nats-url", u.url, "--data-dir", filepath.Join(u.dir, "health-rebuild"), "--rebuild-views")
	if out, err := cmd.CombinedOutput(); err != nil {
		u.t.Fatalf("health --rebuild-views: %v\n%s", err, out)
	}
	for bucket, want := range before {
		if got := u.views(bucket); !sameViews(got, want) {
			u.t.Errorf("%s differs after a rebuild:\n got %s\nwant %s", bucket, dump(got), dump(want))
		}
	}
	u.t.Logf("views identical to a rebuild (%d proxies, %d pools)", len(before[bus.BucketProxies]), len(before[bus.BucketPools]))
}

// goldenMsg is one FLEET_EVENTS message of a golden log.
type goldenMsg struct {
	Seq     uint64          `json:"seq"`
	Subject string          `json:"subject"`
	Header  nats.Header     `json:"header,omitempty"`
	Data    json.RawMessage `json:"data"`
}

// TestGoldenLogWrite writes the golden event log (make golden-log, by
// hand, not CI): the release in PROXYFLEET_PREV_BIN runs a scenario
// through the API — two pools applied, one scaled, a proxy killed and
// replaced, a ban reported, a proxy recycled, a pool deleted — and its
// FLEET_EVENTS (events.json) and final views (views.json) are written to
// the directory PROXYFLEET_GOLDEN_WRITE. The replay tests of make test
// (services/planner, services/health) read them.
func TestGoldenLogWrite(t *testing.T) {
	out := os.Getenv("PROXYFLEET_GOLDEN_WRITE")
	if out == "" {
		t.Skip("PROXYFLEET_GOLDEN_WRITE is not set: make golden-log writes the golden event log")
	}
	rel := prevRelease(t)
	u := newUpgradeFleet(t, rel)
	u.startPlanner(rel, "planner-1")
	u.startHealth(rel)
	u.startAgent(rel)
	u.waitAgent("local", "t1")
	u.waitLeader()
	ctx := context.Background()

	u.apply(events.PoolSpec{Name: "alpha", Provider: "local", Size: 2})
	u.apply(events.PoolSpec{Name: "beta", Provider: "local", Size: 1})
	u.waitPool("alpha", 2, "ready", 90*time.Second)
	u.waitPool("beta", 1, "ready", 90*time.Second)
	u.apply(events.PoolSpec{Name: "alpha", Provider: "local", Size: 3})
	alpha := u.waitPool("alpha", 3, "ready", 90*time.Second)

	replaced := func(what, pool, id string, n int) []proxyView {
		var got []proxyView
		waitFor(t, 120*time.Second, what, func() bool {
			got = u.proxies(pool)
			ready := 0
			for _, p := range got {
				if p.ID == id {
					return false
				}
				if p.State == "ready" {
					ready++
				}
			}
			return len(got) == n && ready == n
		})
		return got
	}
	// kill -9 of a proxy process: health finds it down, the planner
	// replaces it.
	killed := alpha[0].ID
	if err := syscall.Kill(u.statePID(killed), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	alpha = replaced("the killed proxy "+killed+" replaced", "alpha", killed, 3)
	banned := alpha[0].ID
	if _, err := u.api.ReportBan(ctx, api.ProxyBanRequest{ID: banned, Reason: "403 from the golden site"}); err != nil {
		t.Fatalf("report-ban %s: %v", banned, err)
	}
	replaced("the banned proxy "+banned+" replaced", "alpha", banned, 3)
	beta := u.proxies("beta")
	if _, err := u.api.Recycle(ctx, api.ProxyRecycleRequest{ID: beta[0].ID, Now: true}); err != nil {
		t.Fatalf("recycle %s: %v", beta[0].ID, err)
	}
	replaced("the recycled proxy "+beta[0].ID+" replaced", "beta", beta[0].ID, 1)
	u.deletePoolAndWait("beta")

	// Quiesce: the log is final once every writer stopped.
	for _, n := range []string{"planner-1", "local-agent", "health"} {
		u.stop(n)
	}
	s, err := u.conn.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []goldenMsg
	gaps := 0
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			gaps++ // an expired fence message
			continue
		}
		if err != nil {
			t.Fatalf("FLEET_EVENTS %d: %v", seq, err)
		}
		if !json.Valid(m.Data) {
			t.Fatalf("FLEET_EVENTS %d (%s) is not JSON: %.200q", seq, m.Subject, m.Data)
		}
		msgs = append(msgs, goldenMsg{Seq: m.Sequence, Subject: m.Subject, Header: m.Header, Data: m.Data})
	}
	views := map[string]map[string]json.RawMessage{}
	for _, bucket := range []string{bus.BucketProxies, bus.BucketPools} {
		views[bucket] = map[string]json.RawMessage{}
		for k, v := range u.views(bucket) {
			views[bucket][k] = v
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	b.WriteString("[\n")
	for i, m := range msgs {
		line, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(line)
		if i < len(msgs)-1 {
			b.WriteString(",")
		}
		b.WriteString("\n")
	}
	b.WriteString("]\n")
	vb, err := json.MarshalIndent(views, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	readme := fmt.Sprintf("The golden event log of release %s (make golden-log; docs/upgrading.md).\n\n"+
		"events.json: every FLEET_EVENTS message (stream sequence, subject, headers, data) of a scenario run\n"+
		"through the API by %s's binaries: pools alpha (2) and beta (1) applied, alpha scaled to 3, a proxy\n"+
		"killed (kill -9) and replaced, a ban reported, a proxy recycled, pool beta deleted.\n"+
		"views.json: %s's fleet-proxies and fleet-pools at the end.\n\n"+
		"Every later version replays it in make test (services/planner and services/health golden tests).\n"+
		"Never edit these files by hand.\n", rel.version, rel.version, rel.version)
	for name, data := range map[string][]byte{"events.json": []byte(b.String()), "views.json": append(vb, '\n'), "README": []byte(readme)} {
		if err := os.WriteFile(filepath.Join(out, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("golden log of %s: %d events (%d expired sequences), %d proxies and %d pools in the views, written to %s", rel.version, len(msgs), gaps,
		len(views[bus.BucketProxies]), len(views[bus.BucketPools]), out)
}
