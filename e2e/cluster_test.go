//go:build cluster

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
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
)

// natsNode is one nats-server process of the test's cluster.
type natsNode struct {
	name   string
	store  string // JetStream store directory, kept across restarts
	run    string // config, ports file and log
	cmd    *exec.Cmd
	client string // nats://127.0.0.1:port, chosen by the kernel at each start
	route  string // nats://127.0.0.1:port of the cluster listener
}

// natsCluster is three nats-server processes on loopback, routed into one
// JetStream cluster with file stores in temporary directories.
//
// Every port comes from the kernel (listen 127.0.0.1:-1); each server
// writes what it bound to its ports file. A clustered JetStream server
// must start with its full route list (its length sets the meta group's
// expected size), so every server lists three routes: the cluster
// addresses of the servers already running, and for the others a reserved
// address that refuses (pkg/testnet), which the server keeps retrying while
// gossip joins the real ones. A restarted node gets new ports and routes to
// the running ones; the others learn its new address by gossip.
type natsCluster struct {
	t        *testing.T
	bin      string
	nodes    []*natsNode
	refusing []string
}

func startNATSCluster(t *testing.T, bin string) *natsCluster {
	t.Helper()
	c := &natsCluster{t: t, bin: bin}
	for i := 0; i < 3; i++ {
		c.refusing = append(c.refusing, "nats://"+testnet.Refusing(t).String())
		c.nodes = append(c.nodes, &natsNode{name: fmt.Sprintf("n%d", i+1), store: t.TempDir(), run: t.TempDir()})
	}
	for i := range c.nodes {
		c.start(i)
	}
	t.Cleanup(func() {
		for i := range c.nodes {
			c.stopNode(i, syscall.SIGTERM)
		}
	})
	return c
}

// start starts node i (again) with its store, routing to the running
// nodes.
func (c *natsCluster) start(i int) {
	c.t.Helper()
	n := c.nodes[i]
	var routes []string
	for j, o := range c.nodes {
		if j != i && o.cmd != nil && o.route != "" {
			routes = append(routes, fmt.Sprintf("%q", o.route))
		} else {
			routes = append(routes, fmt.Sprintf("%q", c.refusing[j]))
		}
	}
	conf := fmt.Sprintf(`server_name: %s
listen: "127.0.0.1:-1"
jetstream { store_dir: %q }
cluster {
  name: proxyfleet-test
  listen: "127.0.0.1:-1"
  # A peer that stops answering (SIGSTOP) is dropped after 3 unanswered
  # pings, as docs/scaling.md recommends, not after the default minutes.
  ping_interval: "2s"
  ping_max: 3
  routes: [%s]
}
`, n.name, n.store, strings.Join(routes, ", "))
	confPath := filepath.Join(n.run, "nats-server.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		c.t.Fatal(err)
	}
	ports := filepath.Join(n.run, "ports")
	_ = os.RemoveAll(ports)
	if err := os.MkdirAll(ports, 0o700); err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command(c.bin, "-c", confPath, "--ports_file_dir", ports, "-l", filepath.Join(n.run, "nats-server.log"))
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s: %v", n.name, err)
	}
	n.cmd = cmd
	portsFile := filepath.Join(ports, fmt.Sprintf("%s_%d.ports", filepath.Base(c.bin), cmd.Process.Pid))
	var p struct {
		Nats    []string `json:"nats"`
		Cluster []string `json:"cluster"`
	}
	waitFor(c.t, 30*time.Second, n.name+"'s ports file", func() bool {
		b, err := os.ReadFile(portsFile)
		return err == nil && json.Unmarshal(b, &p) == nil && len(p.Nats) > 0 && len(p.Cluster) > 0
	})
	n.client, n.route = p.Nats[0], p.Cluster[0]
}

// stopNode ends node i with sig (SIGKILL is a crash) and waits for it.
func (c *natsCluster) stopNode(i int, sig syscall.Signal) {
	n := c.nodes[i]
	if n.cmd == nil {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGCONT) // a stopped node must run to exit
	testwait.Stop(n.cmd, sig, 20*time.Second)
	n.cmd = nil
}

func (c *natsCluster) index(name string) int {
	for i, n := range c.nodes {
		if n.name == name {
			return i
		}
	}
	c.t.Fatalf("no cluster node named %q", name)
	return -1
}

// urls is the comma-separated client URLs of the nodes as last started,
// the --nats-url of every service.
func (c *natsCluster) urls() string {
	var u []string
	for _, n := range c.nodes {
		u = append(u, n.client)
	}
	return strings.Join(u, ",")
}

// connect dials the cluster as a service does and waits until JetStream
// answers (the meta leader is elected).
func (c *natsCluster) connect() *bus.Conn {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		actx, acancel := context.WithTimeout(ctx, 3*time.Second)
		conn, err := bus.Connect(actx, bus.Config{URL: c.urls(), Name: "cluster-test"}, nil)
		acancel()
		if err == nil {
			if conn.Replicas() != 3 {
				c.t.Fatalf("connected to the cluster with %d replicas, want 3 chosen from the cluster", conn.Replicas())
			}
			c.t.Cleanup(conn.Close)
			return conn
		}
		if ctx.Err() != nil {
			c.t.Fatalf("cluster: %v", err)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// leaderOf returns the server name leading stream's Raft group.
func leaderOf(t *testing.T, conn *bus.Conn, stream string) string {
	t.Helper()
	var leader string
	waitFor(t, 60*time.Second, "a leader of "+stream, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		s, err := conn.JS.Stream(ctx, stream)
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		if err != nil || info.Cluster == nil || info.Cluster.Leader == "" {
			return false
		}
		leader = info.Cluster.Leader
		return true
	})
	return leader
}

// clusterFleet is the whole system on the cluster: 2 planners, 2 health
// replicas, local agents on t1 and t2.
type clusterFleet struct {
	*fleet
	nc        *natsCluster
	stateDirs map[string]string // target → local-agent state directory
	echo      string            // ip:port of the probes' echo endpoint
	lostCmds  int
}

const (
	clusterGCGrace = 5 * time.Second
	// clusterDupWindow shortens FLEET_CMDS' and FLEET_EVENTS' duplicate
	// window (bus.DuplicateWindow, 2 minutes) for the test, through the
	// streams' own configuration, so that a node can be stopped for
	// longer than it within the test's time.
	clusterDupWindow = 20 * time.Second
)

func newClusterFleet(t *testing.T) *clusterFleet {
	t.Helper()
	bin := os.Getenv("PROXYFLEET_NATS_SERVER")
	testgate.Need(t, bin != "", "no nats-server: make test-cluster builds the pinned one and sets PROXYFLEET_NATS_SERVER")
	needBinaries(t)
	nc := startNATSCluster(t, bin)
	conn := nc.connect()
	// The echo endpoint answers {"ip": caller}, as health's own does.
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"ip": host})
	}))
	t.Cleanup(echo.Close)
	cf := &clusterFleet{nc: nc, stateDirs: map[string]string{}, echo: echo.Listener.Addr().String()}
	cf.fleet = &fleet{t: t, conn: conn, api: api.NewClient(conn.NC, api.WithTimeout(5*time.Second)), dir: t.TempDir(), procs: map[string]*exec.Cmd{}}
	t.Cleanup(cf.stopAll)
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		names := []string{"planner-1", "planner-2", "health-1", "health-2", "agent-t1", "agent-t2"}
		// Every service still running prints its goroutines (SIGQUIT)
		// into its log: where a stuck one waits.
		cf.mu.Lock()
		var quit []*exec.Cmd
		for _, n := range names {
			if c := cf.procs[n]; c != nil {
				quit = append(quit, c)
				delete(cf.procs, n)
			}
		}
		cf.mu.Unlock()
		for _, c := range quit {
			_ = c.Process.Signal(syscall.SIGQUIT)
		}
		for _, c := range quit {
			done := make(chan struct{})
			go func() { _ = c.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				_ = c.Process.Kill()
				<-done
			}
		}
		// Keep the whole logs (services and servers) for the post-mortem.
		if keep, err := os.MkdirTemp("", "proxyfleet-cluster-logs-"); err == nil {
			for _, n := range names {
				_ = os.WriteFile(filepath.Join(keep, n+".log"), []byte(cf.log(n)), 0o644)
			}
			for _, n := range nc.nodes {
				b, _ := os.ReadFile(filepath.Join(n.run, "nats-server.log"))
				_ = os.WriteFile(filepath.Join(keep, n.name+".log"), b, 0o644)
			}
			t.Logf("logs kept in %s", keep)
		}
		for _, n := range names {
			l := cf.log(n)
			if len(l) > 4000 {
				l = l[len(l)-4000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})
	// The topology as an operator creates it: planner bootstrap, R3 on
	// the cluster; the services then bind it (--ensure-topology=false).
	ctx := context.Background()
	boot := exec.Command(filepath.Join(binDir, "planner"), "bootstrap", "--nats-url", nc.urls(),
		"--data-dir", filepath.Join(cf.dir, "bootstrap"), "--agent", "local/t1", "--agent", "local/t2")
	if out, err := boot.CombinedOutput(); err != nil {
		t.Fatalf("planner bootstrap: %v\n%s", err, out)
	}
	for _, name := range []string{bus.EventsStream, bus.CommandsStream} {
		s, err := conn.JS.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		if cfg.Replicas != 3 {
			t.Fatalf("%s has %d replicas after bootstrap on the cluster, want 3", name, cfg.Replicas)
		}
		cfg.Duplicates = clusterDupWindow
		if _, err := conn.JS.UpdateStream(ctx, cfg); err != nil {
			t.Fatalf("shorten %s's duplicate window: %v", name, err)
		}
	}
	kv, err := conn.JS.KeyValue(ctx, bus.BucketPlanner)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := kv.Status(ctx); err != nil || st.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.Replicas != 3 {
		t.Fatalf("the planner's lease bucket is not R3: %v", err)
	}
	return cf
}

// svc starts a service binary against every node of the cluster.
func (cf *clusterFleet) svc(name, bin string, args ...string) {
	cf.t.Helper()
	common := []string{"--nats-url", cf.nc.urls(), "--data-dir", filepath.Join(cf.dir, name),
		"--ensure-topology=false", "--log-level", "debug"}
	cf.startBinaryArgs(name, filepath.Join(binDir, bin), nil, append(common, args...))
}

func (cf *clusterFleet) startPlanner(id string) {
	cf.svc("planner-"+id, "planner", "--id", "planner-"+id, "--reconcile-interval", "300ms",
		"--gc-interval", "1s", "--gc-grace", clusterGCGrace.String())
}

// startHealth starts a health replica probing through the test's echo
// endpoint (--echo-url), which outlives the replicas' restarts, as an
// external one would in a multi-host deployment.
func (cf *clusterFleet) startHealth(id string) {
	cf.svc("health-"+id, "health", "--echo-addr", "", "--echo-url", "http://"+cf.echo+"/",
		"--probe-interval", "500ms", "--probe-timeout", "3s")
}

func (cf *clusterFleet) startAgent(target string) {
	dir, ok := cf.stateDirs[target]
	if !ok {
		dir = cf.t.TempDir()
		cf.stateDirs[target] = dir
	}
	args := []string{"--entry", "local", "--target", target, "--state-dir", dir, "--ports", "0", "--capacity", "40"}
	args = append(args, "--egress-allow", cf.echo)
	cf.svc("agent-"+target, "local-agent", args...)
}

func (cf *clusterFleet) startAll() {
	cf.startHealth("1")
	cf.startHealth("2")
	cf.startAgent("t1")
	cf.startAgent("t2")
	cf.startPlanner("1")
	cf.startPlanner("2")
	cf.waitAgent("local", "t1")
	cf.waitAgent("local", "t2")
	cf.waitLeader()
}

// currentTerm returns the planner's current leader term.
func (cf *clusterFleet) currentTerm() *bus.Term {
	cf.t.Helper()
	var term *bus.Term
	waitFor(cf.t, 60*time.Second, "the planner's current term", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		cur, err := bus.NewEventStore(cf.conn, "cluster-test", nil).CurrentTerm(ctx)
		if err != nil || cur == nil {
			return false
		}
		term = cur
		return true
	})
	return term
}

// apply sets pool's size, retrying while the cluster elects leaders.
func (cf *clusterFleet) apply(pool string, size int) {
	cf.t.Helper()
	spec := events.PoolSpec{Name: pool, Provider: "local", Size: size}
	waitFor(cf.t, 90*time.Second, fmt.Sprintf("pool.apply %+v", spec), func() bool {
		_, err := cf.api.PoolApply(context.Background(), spec)
		return err == nil
	})
}

// proxyEvents returns, per proxy id, the types of its events in
// FLEET_EVENTS: a planner's decision as "requested", an agent's
// observation as "agent:running".
func (cf *clusterFleet) proxyEvents() map[string]map[string]bool {
	cf.t.Helper()
	out := map[string]map[string]bool{}
	waitFor(cf.t, 60*time.Second, "FLEET_EVENTS' subjects", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s, err := cf.conn.JS.Stream(ctx, bus.EventsStream)
		if err != nil {
			return false
		}
		info, err := s.Info(ctx, jetstream.WithSubjectFilter("fleet.evt.proxy.>"))
		if err != nil {
			return false
		}
		for subj := range info.State.Subjects {
			tok := strings.Split(subj, ".")
			if len(tok) < 5 {
				continue
			}
			id, typ := tok[3], tok[4]
			if len(tok) > 5 {
				typ = "agent:" + typ
			}
			if out[id] == nil {
				out[id] = map[string]bool{}
			}
			out[id][typ] = true
		}
		return true
	})
	return out
}

// decisions counts the planner's proxy decisions (requested, retiring).
func (cf *clusterFleet) decisions() int {
	n := 0
	for _, types := range cf.proxyEvents() {
		if types[events.ProxyRequested] {
			n++
		}
		if types[events.ProxyRetiring] {
			n++
		}
	}
	return n
}

// instances lists the live proxy processes per instance name across both
// agents' state directories; a name counted twice is a duplicate instance.
func (cf *clusterFleet) instances() map[string]int {
	out := map[string]int{}
	for _, dir := range cf.stateDirs {
		for _, pid := range proxyProcesses(agentExe(), dir) {
			cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
			if err != nil {
				continue
			}
			out[filepath.Base(cwd)]++
		}
	}
	return out
}

// invariants waits until every pool has exactly its size of ready
// proxies (no lost intent) and the live proxy processes are exactly the
// instances of those proxies once GC's grace has passed (no leaked
// instance), failing at once on a proxy running twice (no duplicate
// instance); then checks that every create command the planner decided was
// executed by an agent (commands lost).
func (cf *clusterFleet) invariants(label string, sizes map[string]int) {
	cf.t.Helper()
	// The views are re-read at every poll: one read may be served by a
	// replica that is still catching up.
	var got map[string]int
	var want map[string]bool
	var pending string
	deadline := clusterGCGrace + 3*time.Minute
	ok := poll(deadline, func() bool {
		want, pending = map[string]bool{}, ""
		for pool, n := range sizes {
			ps := cf.proxies(pool)
			ready := 0
			for _, p := range ps {
				want[events.InstanceName(p.ID)] = true
				if p.State == "ready" {
					ready++
				}
			}
			if len(ps) != n || ready != n {
				pending = fmt.Sprintf("pool %s has %d proxies, %d ready, want %d", pool, len(ps), ready, n)
			}
		}
		got = cf.instances()
		for name, n := range got {
			if n > 1 {
				cf.t.Fatalf("%s: duplicate instance: %s runs %d times across the agents", label, name, n)
			}
		}
		if pending != "" || len(got) != len(want) {
			return false
		}
		for name := range want {
			if got[name] != 1 {
				return false
			}
		}
		return true
	})
	if !ok {
		cf.t.Fatalf("%s: after %s: %s; live instances %v, the pools' proxies %v", label, deadline, pending, got, want)
	}
	// The stream's subjects are read from whichever node answers: one that
	// has just resumed may answer before it has the agents' latest
	// observations, so a proxy's observation is waited for a while before
	// its command counts as lost.
	var lostIDs []string
	testwait.For(testwait.Context(cf.t, 30*time.Second), func() bool {
		lostIDs = nil
		for id, types := range cf.proxyEvents() {
			if !types[events.ProxyRequested] {
				continue
			}
			executed := false
			for typ := range types {
				if strings.HasPrefix(typ, "agent:") {
					executed = true
				}
			}
			if !executed {
				lostIDs = append(lostIDs, id)
			}
		}
		return len(lostIDs) == 0
	})
	lost := len(lostIDs)
	sort.Strings(lostIDs)
	cf.t.Logf("cluster: %s: commands lost: %d", label, lost)
	if lost != 0 {
		cf.t.Fatalf("%s: %d create commands decided but never executed by an agent: %v", label, lost, lostIDs)
	}
}

// TestClusterLifecycle runs the whole system on a three-node nats-server
// cluster: two planners, two health replicas, local agents on two
// targets, every stream and bucket R3; one pool is created, scaled and
// deleted.
func TestClusterLifecycle(t *testing.T) {
	cf := newClusterFleet(t)
	cf.startAll()
	cf.apply("life", 3)
	cf.invariants("lifecycle: created", map[string]int{"life": 3})
	cf.apply("life", 1)
	cf.invariants("lifecycle: scaled down", map[string]int{"life": 1})
	targets := map[string]bool{}
	cf.apply("life", 4)
	cf.waitPool("life", 4, "ready", 3*time.Minute)
	for target, dir := range cf.stateDirs {
		if len(proxyProcesses(agentExe(), dir)) > 0 {
			targets[target] = true
		}
	}
	cf.t.Logf("cluster: lifecycle: proxies placed on %d targets", len(targets))
	cf.invariants("lifecycle: scaled up", map[string]int{"life": 4})
	cf.deletePool("life")
	cf.invariants("lifecycle: deleted", map[string]int{"life": 0})
}

// sinceFault polls until the planner has appended a proxy decision
// (requested or retiring) beyond before, and returns the time since t0.
func (cf *clusterFleet) nextDecision(label string, t0 time.Time, before int) time.Duration {
	cf.t.Helper()
	var took time.Duration
	waitFor(cf.t, 3*time.Minute, label+": the next planner decision", func() bool {
		if cf.decisions() > before {
			took = time.Since(t0)
			return true
		}
		return false
	})
	cf.t.Logf("cluster: %s: next decision after %s", label, took.Round(time.Millisecond))
	return took
}

// dupProbe republishes the most recent proxy events (stored within the
// last few seconds, well inside the duplicate window) with their own
// Nats-Msg-Id, as a service retrying a publish whose acknowledgement the
// fault swallowed would: the stream's new leader must drop every one
// (PubAck.Duplicate) and the stream must not grow. It returns how many
// were dropped.
func (cf *clusterFleet) dupProbe(label string) int {
	cf.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// Right after a fault JetStream may answer "temporarily unavailable"
	// while groups elect leaders: asked again until the context ends.
	var s jetstream.Stream
	var info *jetstream.StreamInfo
	for {
		var err error
		if s, err = cf.conn.JS.Stream(ctx, bus.EventsStream); err == nil {
			if info, err = s.Info(ctx); err == nil {
				break
			}
		}
		if ctx.Err() != nil {
			cf.t.Fatalf("%s: stream info: %v", label, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	last := info.State.LastSeq
	// The messages are read from the stream's leader: the JetStream
	// context of nats.go's first API gets a message through the leader
	// unless told to get it directly. A stream that allows direct gets
	// serves them from its followers too, and a follower enables them once
	// it is 90% caught up: right after a node restarts, a direct get of
	// the newest messages can answer "not found". The probe is about what
	// the leader holds.
	leader, err := cf.conn.NC.JetStream()
	if err != nil {
		cf.t.Fatal(err)
	}
	var msgs []*nats.RawStreamMsg
	var getErrs []string
	for seq := last; seq > 0 && seq+200 > last && len(msgs) < 5; seq-- {
		m, err := leader.GetMsg(bus.EventsStream, seq, nats.Context(ctx))
		if err != nil {
			getErrs = append(getErrs, fmt.Sprintf("%d: %v", seq, err))
			continue
		}
		if !strings.HasPrefix(m.Subject, "fleet.evt.proxy.") || m.Header.Get(jetstream.MsgIDHeader) == "" ||
			time.Since(m.Time) > clusterDupWindow/2 {
			continue
		}
		msgs = append(msgs, m)
	}
	if len(msgs) == 0 {
		cf.t.Fatalf("%s: no recent proxy event to republish among seqs %d back from %d (failed reads: %v)", label, min(last, 200), last, getErrs)
	}
	dropped := 0
	for _, m := range msgs {
		msg := &nats.Msg{Subject: m.Subject, Data: m.Data, Header: nats.Header{}}
		msg.Header.Set(jetstream.MsgIDHeader, m.Header.Get(jetstream.MsgIDHeader))
		ack, err := cf.conn.JS.PublishMsg(ctx, msg)
		for err != nil && ctx.Err() == nil {
			// Another try is one more duplicate: it changes nothing.
			time.Sleep(200 * time.Millisecond)
			ack, err = cf.conn.JS.PublishMsg(ctx, msg)
		}
		if err != nil {
			cf.t.Fatalf("%s: republish %s: %v", label, m.Subject, err)
		}
		if !ack.Duplicate {
			cf.t.Fatalf("%s: republished %s (Msg-Id %s) was stored again at seq %d: Msg-Id deduplication lost across the fault",
				label, m.Subject, m.Header.Get(jetstream.MsgIDHeader), ack.Sequence)
		}
		dropped++
	}
	cf.t.Logf("cluster: %s: duplicate events dropped by Msg-Id: %d of %d republished", label, dropped, len(msgs))
	return dropped
}

// caughtUp waits until every replica of stream is current again.
func (cf *clusterFleet) caughtUp(label, stream string) {
	cf.t.Helper()
	waitFor(cf.t, 2*time.Minute, label+": every replica of "+stream+" current", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		s, err := cf.conn.JS.Stream(ctx, stream)
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		if err != nil || info.Cluster == nil || info.Cluster.Leader == "" || len(info.Cluster.Replicas) != 2 {
			return false
		}
		for _, r := range info.Cluster.Replicas {
			if !r.Current || r.Offline || r.Lag != 0 {
				return false
			}
		}
		return true
	})
}

// viewsMatchRebuild stops every writer, rebuilds fleet-proxies and
// fleet-pools from FLEET_EVENTS (health --rebuild-views) and requires
// them byte-identical to what the running services projected; then starts
// the services again.
func (cf *clusterFleet) viewsMatchRebuild(label string) {
	cf.t.Helper()
	names := []string{"planner-1", "planner-2", "health-1", "health-2", "agent-t1", "agent-t2"}
	for _, n := range names {
		cf.stop(n)
	}
	cf.rebuildMatches("cluster", label)
	cf.startAll()
}

// churn scales pool a and b in opposite directions and waits until the
// planner has started acting on it, so that the fault lands mid-scale.
func (cf *clusterFleet) churn(sizes map[string]int, a, b int) {
	cf.t.Helper()
	before := cf.decisions()
	sizes["a"], sizes["b"] = a, b
	cf.apply("a", a)
	cf.apply("b", b)
	waitFor(cf.t, 60*time.Second, "the planner acting on the new sizes", func() bool { return cf.decisions() > before })
}

// TestClusterFaults kills, restarts and stops nats-server nodes of the
// cluster while pools scale up and down, and checks after each fault that
// no proxy runs twice, none leaks past GC's grace, every pool reaches its
// size, every decided create command was executed, Msg-Id deduplication
// still holds and the views equal a rebuild from the log.
//
// The safeguards each scenario relies on (docs/scaling.md):
//   - every fault: commands and events carry a deterministic Nats-Msg-Id
//     (bus.PublishCommand, EventStore.Append, the fenced decisions), so a
//     publish retried after a lost acknowledgement is dropped, not doubled;
//     pkg/bus's TestCommandRepublishDedup fails without it. Agents key
//     instances by events.InstanceName(proxy id) and adopt what runs.
//   - FLEET_EVENTS leader killed: R3 file store, acknowledged only once a
//     quorum has it; the new leader rebuilds its duplicate table from the
//     stored Msg-Ids (the republish probe below fails without it).
//   - lease bucket leader and leader planner killed: the lease's TTL and
//     the term fence (AppendFenced) keep one writer; a second leader's
//     decisions are refused (pkg/bus TestFencedAppendOnReplicatedStream).
//   - node restarted with its store: Raft catch-up from the store plus
//     the leader's log; the node must be current again before the next one.
//   - node stopped longer than the duplicate window: the window is
//     shortened to 20s on the streams' own configuration; the stopped
//     node holds no leadership once stopped, and the agents' instance
//     names make a create redelivered after the window idempotent.
func TestClusterFaults(t *testing.T) {
	cf := newClusterFleet(t)
	cf.startAll()
	sizes := map[string]int{"a": 2, "b": 3}
	cf.apply("a", 2)
	cf.apply("b", 3)
	cf.invariants("start", sizes)

	// (a) kill -9 the node leading FLEET_EVENTS while pools scale.
	{
		label := "fault a (FLEET_EVENTS leader killed)"
		leader := leaderOf(t, cf.conn, bus.EventsStream)
		cf.churn(sizes, 4, 1)
		at := cf.decisions()
		t0 := time.Now()
		i := cf.nc.index(leader)
		cf.nc.stopNode(i, syscall.SIGKILL)
		t.Logf("cluster: %s: killed %s", label, leader)
		sizes["a"], sizes["b"] = 3, 2
		cf.apply("a", 3)
		cf.apply("b", 2)
		cf.nextDecision(label, t0, at)
		if nl := leaderOf(t, cf.conn, bus.EventsStream); nl == leader {
			t.Fatalf("%s: %s still leads FLEET_EVENTS after being killed", label, leader)
		}
		cf.dupProbe(label)
		cf.nc.start(i)
		cf.caughtUp(label, bus.EventsStream)
		cf.invariants(label, sizes)
		cf.viewsMatchRebuild(label)
	}

	// (b) kill -9 the node leading the lease bucket and the leader planner
	// together: planner failover.
	{
		label := "fault b (lease bucket leader and leader planner killed)"
		kvLeader := leaderOf(t, cf.conn, "KV_"+bus.BucketPlanner)
		cf.churn(sizes, 2, 3)
		// The leader's term right before its death: a lease lost and won
		// again during the churn (a busy machine) opens a new one.
		term := cf.currentTerm()
		at := cf.decisions()
		t0 := time.Now()
		i := cf.nc.index(kvLeader)
		cf.nc.stopNode(i, syscall.SIGKILL)
		cf.kill9(term.Leader)
		t.Logf("cluster: %s: killed node %s and %s (term %d)", label, kvLeader, term.Leader, term.Number)
		sizes["a"], sizes["b"] = 4, 2
		cf.apply("a", 4)
		cf.apply("b", 2)
		took := cf.nextDecision(label, t0, at)
		next := cf.currentTerm()
		if next.Number <= term.Number || next.Leader == term.Leader {
			// The decision counted may be one the dead leader made in its
			// last moments (after at, before the kill): the failover is
			// done when another replica's term is in the log.
			waitFor(t, bus.LeaseTTL+30*time.Second, label+": a term of another replica", func() bool {
				next = cf.currentTerm()
				return next.Number > term.Number && next.Leader != term.Leader
			})
			took = time.Since(t0)
		}
		t.Logf("cluster: planner failover: %s from the leader's death to the new leader's first decision (lease TTL %s, term %d by %s)",
			took.Round(time.Millisecond), bus.LeaseTTL, next.Number, next.Leader)
		// The target is lease TTL + 1s; two shared cores and a Raft
		// election of the lease bucket get a generous margin.
		if limit := bus.LeaseTTL + 30*time.Second; took > limit {
			t.Fatalf("%s: planner failover took %s, more than %s", label, took, limit)
		}
		cf.dupProbe(label)
		cf.nc.start(i)
		cf.startPlanner(strings.TrimPrefix(term.Leader, "planner-"))
		cf.caughtUp(label, "KV_"+bus.BucketPlanner)
		cf.invariants(label, sizes)
		cf.viewsMatchRebuild(label)
	}

	// (c) restart a node with its store intact (the FLEET_CMDS leader).
	{
		label := "fault c (node restarted with its store)"
		leader := leaderOf(t, cf.conn, bus.CommandsStream)
		cf.churn(sizes, 2, 4)
		at := cf.decisions()
		t0 := time.Now()
		i := cf.nc.index(leader)
		cf.nc.stopNode(i, syscall.SIGTERM)
		cf.nc.start(i)
		t.Logf("cluster: %s: restarted %s", label, leader)
		sizes["a"], sizes["b"] = 3, 3
		cf.apply("a", 3)
		cf.apply("b", 3)
		cf.nextDecision(label, t0, at)
		cf.dupProbe(label)
		cf.caughtUp(label, bus.EventsStream)
		cf.caughtUp(label, bus.CommandsStream)
		cf.invariants(label, sizes)
	}

	// (d) stop a node (SIGSTOP) for longer than the duplicate window while
	// pools scale, then let it run again.
	{
		label := "fault d (node stopped past the duplicate window)"
		leader := leaderOf(t, cf.conn, bus.EventsStream)
		cf.churn(sizes, 1, 4)
		at := cf.decisions()
		i := cf.nc.index(leader)
		t0 := time.Now()
		if err := cf.nc.nodes[i].cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		t.Logf("cluster: %s: stopped %s for %s", label, leader, clusterDupWindow+5*time.Second)
		sizes["a"], sizes["b"] = 3, 2
		cf.apply("a", 3)
		cf.apply("b", 2)
		cf.nextDecision(label, t0, at)
		cf.dupProbe(label)
		cf.waitPool("a", 3, "ready", 3*time.Minute)
		cf.waitPool("b", 2, "ready", 3*time.Minute)
		// The stop must outlast the window; waiting is the point here.
		waitFor(t, 2*clusterDupWindow, "the duplicate window to pass", func() bool {
			return time.Since(t0) > clusterDupWindow+5*time.Second
		})
		if err := cf.nc.nodes[i].cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		cf.caughtUp(label, bus.EventsStream)
		cf.caughtUp(label, bus.CommandsStream)
		cf.invariants(label, sizes)
		cf.viewsMatchRebuild(label)
	}
}

// lastLine is the last non-empty line of out.
func lastLine(out []byte) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

// poll calls cond until it holds or within has passed, and reports which.
func poll(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

// stopAll stops every service of the fleet and kills the proxies its
// agents left running (the proxies outlive their agents by design).
func (cf *clusterFleet) stopAll() {
	cf.mu.Lock()
	names := make([]string, 0, len(cf.procs))
	for n := range cf.procs {
		names = append(names, n)
	}
	cf.mu.Unlock()
	for _, n := range names {
		cf.stop(n)
	}
	for _, d := range cf.stateDirs {
		for _, pid := range proxyProcesses(agentExe(), d) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// rebuildMatches, with every writer stopped, rebuilds fleet-proxies and
// fleet-pools from FLEET_EVENTS (health --rebuild-views) and requires
// them byte-identical to what the services projected; tier names the
// tier in its log lines.
func (cf *clusterFleet) rebuildMatches(tier, label string) {
	cf.t.Helper()
	// A view is read by direct get, which any replica answers: wait until
	// every replica of both views holds what the projection wrote.
	cf.caughtUp(label, bus.EventsStream)
	cf.caughtUp(label, "KV_"+bus.BucketProxies)
	cf.caughtUp(label, "KV_"+bus.BucketPools)
	snapshot := func() map[string]map[string][]byte {
		return map[string]map[string][]byte{
			bus.BucketProxies: cf.views(bus.BucketProxies),
			bus.BucketPools:   cf.views(bus.BucketPools),
		}
	}
	// Nothing writes any more: two reads a moment apart that agree are
	// what the replicas hold.
	before := snapshot()
	waitFor(cf.t, time.Minute, label+": the views to read the same twice", func() bool {
		time.Sleep(500 * time.Millisecond)
		again := snapshot()
		same := sameViews(again[bus.BucketProxies], before[bus.BucketProxies]) && sameViews(again[bus.BucketPools], before[bus.BucketPools])
		before = again
		return same
	})
	// The rebuild drops and recreates the R3 views: right after a fault
	// the cluster may time out a bucket creation, or refuse to place its
	// replicas until the meta leader hears again from a node that was
	// stopped ("no suitable peers"); the rebuild is idempotent and an
	// operator runs it again.
	deadline := time.Now().Add(2 * time.Minute)
	for attempt := 1; ; attempt++ {
		cmd := exec.Command(filepath.Join(binDir, "health"), "--nats-url", cf.nc.urls(),
			"--data-dir", filepath.Join(cf.dir, "health-rebuild"), "--rebuild-views")
		out, err := cmd.CombinedOutput()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			cf.t.Fatalf("%s: health --rebuild-views: %v\n%s", label, err, out)
		}
		cf.t.Logf("%s: %s: health --rebuild-views attempt %d failed, again: %v: %s", tier, label, attempt, err, lastLine(out))
		time.Sleep(3 * time.Second) // pacing between attempts of an operator's command
	}
	cf.caughtUp(label, "KV_"+bus.BucketProxies)
	cf.caughtUp(label, "KV_"+bus.BucketPools)
	// The rebuilt views are read by direct get too: a replica may serve
	// an older value for a moment, so they must become identical, and a
	// rebuild that differs never does.
	var diff string
	if !poll(time.Minute, func() bool {
		diff = ""
		for bucket, want := range before {
			if got := cf.views(bucket); !sameViews(got, want) {
				diff = fmt.Sprintf("%s differs after rebuild:\n got %s\nwant %s", bucket, dump(got), dump(want))
				return false
			}
		}
		return true
	}) {
		cf.t.Fatalf("%s: %s", label, diff)
	}
	cf.t.Logf("%s: %s: views identical to a rebuild (%d proxies, %d pools)", tier, label,
		len(before[bus.BucketProxies]), len(before[bus.BucketPools]))
}
