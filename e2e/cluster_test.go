//go:build cluster

package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testnet"
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
	_ = n.cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = n.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = n.cmd.Process.Kill()
		<-done
	}
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
	echoes    []string
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
	cf := &clusterFleet{nc: nc, stateDirs: map[string]string{}}
	cf.fleet = &fleet{t: t, conn: conn, dir: t.TempDir(), procs: map[string]*exec.Cmd{}}
	t.Cleanup(func() {
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
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		names := []string{"planner-1", "planner-2", "health-1", "health-2", "agent-t1", "agent-t2"}
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
	cf.startBinaryArgs(name, filepath.Join(binDir, bin), append(common, args...))
}

func (cf *clusterFleet) startBinaryArgs(name, bin string, args []string) {
	cf.t.Helper()
	cmd := exec.Command(bin, args...)
	logf, err := os.OpenFile(filepath.Join(cf.dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		cf.t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		cf.t.Fatalf("start %s: %v", name, err)
	}
	cf.mu.Lock()
	cf.procs[name] = cmd
	cf.mu.Unlock()
}

func (cf *clusterFleet) startPlanner(id string) {
	cf.svc("planner-"+id, "planner", "--id", "planner-"+id, "--reconcile-interval", "300ms",
		"--gc-interval", "1s", "--gc-grace", clusterGCGrace.String())
}

func (cf *clusterFleet) startHealth(id string) {
	cf.svc("health-"+id, "health", "--echo-addr", "127.0.0.1:0", "--probe-interval", "500ms", "--probe-timeout", "3s")
}

func (cf *clusterFleet) startAgent(target string) {
	dir, ok := cf.stateDirs[target]
	if !ok {
		dir = cf.t.TempDir()
		cf.stateDirs[target] = dir
	}
	args := []string{"--entry", "local", "--target", target, "--state-dir", dir, "--ports", "0", "--capacity", "40"}
	for _, e := range cf.echoes {
		args = append(args, "--egress-allow", e)
	}
	cf.svc("agent-"+target, "local-agent", args...)
}

func (cf *clusterFleet) echoOf(name string) string {
	cf.t.Helper()
	var addr string
	waitFor(cf.t, 60*time.Second, name+"'s echo endpoint", func() bool {
		m := echoServing.FindAllStringSubmatch(cf.log(name), -1)
		if len(m) == 0 {
			return false
		}
		addr = m[len(m)-1][1]
		return true
	})
	return addr
}

func (cf *clusterFleet) startAll() {
	cf.startHealth("1")
	cf.startHealth("2")
	cf.echoes = []string{cf.echoOf("health-1"), cf.echoOf("health-2")}
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
	body := fmt.Sprintf(`{"name":%q,"provider":"local","size":%d}`, pool, size)
	waitFor(cf.t, 90*time.Second, "pool.apply "+body, func() bool {
		msg, err := cf.conn.NC.Request("fleet.api.pool.apply", []byte(body), 5*time.Second)
		return err == nil && msg.Header.Get("Nats-Service-Error-Code") == ""
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
	for pool, n := range sizes {
		cf.waitPool(pool, n, "ready", 3*time.Minute)
	}
	want := map[string]bool{}
	for pool := range sizes {
		for _, p := range cf.proxies(pool) {
			want[events.InstanceName(p.ID)] = true
		}
	}
	var got map[string]int
	deadline := clusterGCGrace + 90*time.Second
	waitFor(cf.t, deadline, label+": live instances equal to the pools' proxies (GC grace passed)", func() bool {
		got = cf.instances()
		for name, n := range got {
			if n > 1 {
				cf.t.Fatalf("%s: duplicate instance: %s runs %d times across the agents", label, name, n)
			}
		}
		if len(got) != len(want) {
			return false
		}
		for name := range want {
			if got[name] != 1 {
				return false
			}
		}
		return true
	})
	lost := 0
	var lostIDs []string
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
			lost++
			lostIDs = append(lostIDs, id)
		}
	}
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
	cf.mustReq("fleet.api.pool.delete", `{"name":"life"}`)
	cf.invariants("lifecycle: deleted", map[string]int{"life": 0})
}
