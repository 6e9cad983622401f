package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/events"
)

// Knobs of the planner's benchmarks (go test -bench … -args -planner.…).
var (
	benchStartEvents = flag.Int("planner.start-events", 100_000,
		"events in the log BenchmarkPlannerStart starts from (1000000: the 1M case)")
	benchStartTail = flag.Int("planner.start-tail", 25_000,
		"events after the snapshot in BenchmarkPlannerStart/snapshot (a replica writes one every 50,000 by default)")
)

// benchServer starts an embedded JetStream server with the topology for a
// benchmark; stop shuts it down.
func benchServer(tb testing.TB) (c *bus.Conn, stop func()) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := bus.Connect(ctx, bus.Config{DataDir: tb.TempDir(), Listen: "127.0.0.1:-1", Name: tb.Name(), Embed: embedded.Start}, nil)
	if err != nil {
		tb.Fatalf("embedded NATS: %v", err)
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		c.Close()
		tb.Fatalf("topology: %v", err)
	}
	return c, c.Close
}

// dialBench opens another connection to the server behind c.
func dialBench(tb testing.TB, c *bus.Conn) *bus.Conn {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := bus.Connect(ctx, bus.Config{URL: c.ClientURL(), Name: tb.Name(), Replicas: 1}, nil)
	if err != nil {
		tb.Fatalf("dial NATS: %v", err)
	}
	return d
}

// holdLeaseOn holds the leader lease on c's server until stop is called,
// so the planners a benchmark starts only follow the log.
func holdLeaseOn(tb testing.TB, c *bus.Conn) (stop func()) {
	tb.Helper()
	ctx := context.Background()
	kv, err := c.JS.KeyValue(ctx, bus.BucketPlanner)
	if err != nil {
		tb.Fatal(err)
	}
	rev, err := kv.Create(ctx, leaderKey, []byte("held-by-test"))
	if err != nil {
		tb.Fatal(err)
	}
	hctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(time.Second)
		defer tk.Stop()
		for {
			select {
			case <-hctx.Done():
				return
			case <-tk.C:
				if r, err := kv.Update(hctx, leaderKey, []byte("held-by-test"), rev); err == nil {
					rev = r
				}
			}
		}
	}()
	return func() { cancel(); <-done }
}

// startPlanner runs a planner replica with cfg on its own connection to
// c's server and returns it once its API answers, with the time that took;
// stop ends it.
func startPlanner(tb testing.TB, c *bus.Conn, cfg Config) (p *Planner, took time.Duration, stop func()) {
	tb.Helper()
	conn := dialBench(tb, c)
	start := time.Now()
	p, err := New(conn, cfg, testLogger(), nil, nil)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	stop = func() {
		cancel()
		if err := <-done; err != nil {
			tb.Errorf("Run: %v", err)
		}
		conn.Close()
	}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		if time.Now().After(deadline) {
			stop()
			tb.Fatal("the planner's API never answered")
		}
		if p.Ready() {
			// Ready is set just before the API is added: ask it.
			var err error
			for _, err = range api.NewClient(conn.NC, api.WithTimeout(10*time.Second)).PoolList(context.Background(), api.PoolListRequest{}) {
				break
			}
			if err == nil {
				return p, time.Since(start), stop
			}
			if !errors.Is(err, nats.ErrNoResponders) {
				stop()
				tb.Fatalf("pool.list: %v", err)
			}
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkPlannerStart measures how long a planner replica takes from a
// cold start until its API answers, over a generated log of
// -planner.start-events events (default 100,000; pass
// -args -planner.start-events=1000000 for the 1M case, which takes minutes
// to build):
//
//   - baseline: a bare ordered read of the whole stream (an ordered
//     consumer, no decoding);
//   - replay: a start with no snapshot, replaying the whole log;
//   - snapshot: a start from a snapshot that covers all but the last
//     -planner.start-tail events (default 25,000: half the default
//     snapshot period), which are replayed.
//
// ns/op is the time to an answering API; events/s is the log length over
// it. scripts/bench-ratios.awk prints replay and snapshot as ratios of the
// baseline.
func BenchmarkPlannerStart(b *testing.B) {
	n, tail := *benchStartEvents, min(*benchStartTail, *benchStartEvents/2)
	c, stopServer := benchServer(b)
	defer stopServer()
	release := holdLeaseOn(b, c)
	defer release()
	g := newLogGen(b, c, 1)
	g.fill(n - tail)
	cfg := Config{ID: "bench", SnapshotEvery: -1, SnapshotInterval: -1}

	// The snapshot the last sub-benchmark starts from, written by a
	// replica that replayed the log up to it.
	p, _, stop := startPlanner(b, c, cfg)
	snapSeq, err := p.snap.writeSnapshot(context.Background())
	stop()
	if err != nil {
		b.Fatal(err)
	}
	obs, err := c.JS.ObjectStore(context.Background(), bus.ObjectSnapshots)
	if err != nil {
		b.Fatal(err)
	}
	snapshot, err := obs.GetBytes(context.Background(), snapshotObject)
	if err != nil {
		b.Fatal(err)
	}
	g.fill(n)
	last := streamLast(b, c)
	b.Logf("log: %d events (last sequence %d); snapshot at %d (%d bytes), %d events after it", g.n, last, snapSeq, len(snapshot), last-snapSeq)

	report := func(b *testing.B, total time.Duration) {
		per := total / time.Duration(b.N)
		b.ReportMetric(float64(per.Nanoseconds()), "ns/op")
		b.ReportMetric(float64(last)/per.Seconds(), "events/s")
	}
	b.Run("baseline", func(b *testing.B) {
		var total time.Duration
		for range b.N {
			start := time.Now()
			orderedRead(b, c, last)
			total += time.Since(start)
		}
		report(b, total)
	})
	b.Run("replay", func(b *testing.B) {
		if err := obs.Delete(context.Background(), snapshotObject); err != nil {
			b.Fatal(err)
		}
		var total time.Duration
		for range b.N {
			p, took, stop := startPlanner(b, c, cfg)
			stop()
			if p.snap.loaded != 0 {
				b.Fatalf("started from a snapshot at %d", p.snap.loaded)
			}
			total += took
		}
		report(b, total)
	})
	b.Run("snapshot", func(b *testing.B) {
		meta := jetstream.ObjectMeta{Name: snapshotObject,
			Metadata: map[string]string{metaVersion: fmt.Sprint(snapshotVersion), metaSeq: fmt.Sprint(snapSeq)}}
		if _, err := obs.Put(context.Background(), meta, bytes.NewReader(snapshot)); err != nil {
			b.Fatal(err)
		}
		var total time.Duration
		for range b.N {
			p, took, stop := startPlanner(b, c, cfg)
			stop()
			if p.snap.loaded != snapSeq {
				b.Fatalf("started from snapshot %d, want %d", p.snap.loaded, snapSeq)
			}
			total += took
		}
		report(b, total)
	})
}

// streamLast returns FLEET_EVENTS' last sequence.
func streamLast(tb testing.TB, c *bus.Conn) uint64 {
	tb.Helper()
	s, err := c.JS.Stream(context.Background(), bus.EventsStream)
	if err != nil {
		tb.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	return info.State.LastSeq
}

// orderedRead reads FLEET_EVENTS up to sequence last with an ordered
// consumer, decoding nothing.
func orderedRead(tb testing.TB, c *bus.Conn, last uint64) {
	tb.Helper()
	ctx := context.Background()
	s, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		tb.Fatal(err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		tb.Fatal(err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(1024))
	if err != nil {
		tb.Fatal(err)
	}
	defer it.Stop()
	for {
		m, err := it.Next()
		if err != nil {
			tb.Fatal(err)
		}
		md, err := m.Metadata()
		if err != nil {
			tb.Fatal(err)
		}
		if md.Sequence.Stream >= last {
			return
		}
	}
}

// heapInUse returns the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

var benchConvergeSize = flag.Int("planner.converge-size", 10_000,
	"pool size BenchmarkConverge fills")

// instantAgent is the backend of one target that builds every proxy at
// once: it consumes its target's commands as an agent does (its durable
// consumer on FLEET_CMDS) and answers each create with provisioning and
// running, each delete with deleted, appended asynchronously; it acks a
// command once its events are stored. Every acknowledgement is checked.
type instantAgent struct {
	c             *bus.Conn
	entry, target string
	errs          chan error
}

// messagesPerProxy counts the messages one proxy of a fill costs: the
// fence and the requested decision (one atomic batch), the create
// command, and the agent's provisioning and running.
const messagesPerProxy = 5

func (a *instantAgent) run(ctx context.Context) error {
	cons, err := bus.EnsureAgentConsumer(ctx, a.c, a.entry, a.target)
	if err != nil {
		return err
	}
	source := events.AgentSource(a.entry, a.target)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		env, err := events.DecodeEnvelope(m.Data())
		if err != nil {
			a.fail(err)
			return
		}
		var acks []jetstream.PubAckFuture
		pub := func(id, typ string, n int, data any) {
			msgID := events.ProxyEventID(id, typ, uint64(n))
			e, err := events.NewEnvelope(msgID, source, events.EnvelopeType(events.AggregateProxy, typ), id, time.Now(), data)
			if err != nil {
				a.fail(err)
				return
			}
			body, _ := e.MarshalJSON()
			msg := nats.NewMsg(events.SubjectOf(source, events.AggregateProxy, id, typ))
			msg.Data = body
			msg.Header.Set(jetstream.MsgIDHeader, msgID)
			f, err := a.c.JS.PublishMsgAsync(msg)
			if err != nil {
				a.fail(err)
				return
			}
			acks = append(acks, f)
		}
		switch verb := m.Subject()[strings.LastIndexByte(m.Subject(), '.')+1:]; verb {
		case events.VerbCreate:
			var cmd events.CreateCommand
			if err := env.DecodeData(&cmd); err != nil {
				a.fail(err)
				return
			}
			pub(cmd.ProxyID, events.ProxyProvisioning, cmd.Attempt, events.ProxyProvisioningData{Entry: a.entry, Target: a.target,
				Instance: cmd.Instance, ProviderID: "pid-" + cmd.ProxyID, Attempt: cmd.Attempt})
			pub(cmd.ProxyID, events.ProxyRunning, cmd.Attempt, events.ProxyRunningData{ProviderID: "pid-" + cmd.ProxyID,
				Address: "127.0.0.1:1", Attempt: cmd.Attempt})
		case events.VerbDelete:
			var cmd events.DeleteCommand
			if err := env.DecodeData(&cmd); err != nil {
				a.fail(err)
				return
			}
			pub(cmd.ProxyID, events.ProxyDeleted, cmd.Attempt, events.ProxyDeletedData{Attempt: cmd.Attempt})
		}
		// The command is done once its facts are stored: ack then, off
		// the delivery goroutine.
		go func() {
			for _, f := range acks {
				select {
				case <-f.Ok():
				case err := <-f.Err():
					a.fail(err)
					return
				case <-ctx.Done():
					return
				}
			}
			if err := m.Ack(); err != nil && ctx.Err() == nil {
				a.fail(err)
			}
		}()
	}, jetstream.PullMaxMessages(512))
	if err != nil {
		return err
	}
	<-ctx.Done()
	cc.Stop()
	return nil
}

func (a *instantAgent) fail(err error) {
	select {
	case a.errs <- err:
	default:
	}
}

// BenchmarkConverge measures how fast a leader fills a pool of
// -planner.converge-size proxies (default 10,000) on instant backends:
// four targets whose agents (instantAgent) answer every create with
// provisioning and running at once. ns/op is the time per proxy from
// pool.apply until every proxy of the pool is running in the leader's
// projection; proxies/s is its inverse. The baseline is the ceiling in the
// same run: the time JetStream takes to store messagesPerProxy small
// messages published asynchronously (the messages one proxy costs), so
// scripts/bench-ratios.awk prints converge as the inverse of the fraction
// of the ceiling reached.
func BenchmarkConverge(b *testing.B) {
	size := *benchConvergeSize
	b.Run("baseline", func(b *testing.B) {
		c, stop := benchServer(b)
		defer stop()
		var total time.Duration
		for round := range b.N {
			total += bustest.Ceiling(b, c, round, size*messagesPerProxy)
		}
		per := total / time.Duration(b.N*size)
		b.ReportMetric(float64(per.Nanoseconds()), "ns/op")
		b.ReportMetric(1/per.Seconds(), "proxies/s")
	})
	b.Run("converge", func(b *testing.B) {
		var total time.Duration
		for range b.N {
			total += convergeOnce(b, size)
		}
		per := total / time.Duration(b.N*size)
		b.ReportMetric(float64(per.Nanoseconds()), "ns/op")
		b.ReportMetric(1/per.Seconds(), "proxies/s")
	})
}

// convergeOnce fills one pool of size proxies on a fresh server and
// returns how long it took.
func convergeOnce(b *testing.B, size int) time.Duration {
	b.Helper()
	c, stopServer := benchServer(b)
	defer stopServer()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	agentsKV, err := c.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		b.Fatal(err)
	}
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for _, target := range []string{"t1", "t2", "t3", "t4"} {
		info := agent.Info{Entry: "local", Target: target, Type: "local"}
		now := time.Now().UTC()
		hb, _ := json.Marshal(agent.Heartbeat{Info: info, StartedAt: now, At: now})
		if _, err := agentsKV.Put(ctx, agent.HeartbeatKey("local", target), hb); err != nil {
			b.Fatal(err)
		}
		a := &instantAgent{c: dialBench(b, c), entry: "local", target: target, errs: errs}
		defer a.c.Close()
		wg.Go(func() {
			if err := a.run(ctx); err != nil {
				a.fail(err)
			}
		})
	}
	p, _, stop := startPlanner(b, c, Config{ID: "bench", SnapshotEvery: -1, SnapshotInterval: -1})
	defer stop()
	deadline := time.Now().Add(time.Minute)
	for !p.IsLeader() {
		if time.Now().After(deadline) {
			b.Fatal("no leader")
		}
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	if _, err := api.NewClient(c.NC, api.WithTimeout(30*time.Second)).PoolApply(ctx, events.PoolSpec{Name: "big", Provider: "local", Size: size}); err != nil {
		b.Fatalf("pool.apply: %v", err)
	}
	timeout := time.After(10 * time.Minute)
	for {
		// Read the count the projection keeps, woken by its progress.
		p.mu.Lock()
		running, progressed := 0, p.progressed
		if pl := p.st.pools["big"]; pl != nil {
			running = pl.counts[events.ProxyRunning]
		}
		p.mu.Unlock()
		if running == size {
			took := time.Since(start)
			if v := p.poolView("big"); v.Active != size {
				b.Fatalf("pool: %+v, want exactly %d active", v, size)
			}
			return took
		}
		select {
		case err := <-errs:
			b.Fatalf("agent: %v", err)
		case <-timeout:
			b.Fatalf("pool not running after 10m: %+v", p.poolView("big").States)
		case <-progressed:
		}
	}
}

// BenchmarkPlannerMemory measures what a planner replica holds for its
// state: the live heap (after a collection) and the resident set it adds
// once it has folded a log of one pool of about 10,000 live proxies (some
// fail on the way up) that also rotated 5,000 away (finished proxies
// beyond KeepFinished leave memory).
// It reports both per 10,000 live proxies; the embedded server runs in the
// same process, so the figures are differences from before the replica
// started.
func BenchmarkPlannerMemory(b *testing.B) {
	const live, rotated = 10_000, 5_000
	c, stopServer := benchServer(b)
	defer stopServer()
	release := holdLeaseOn(b, c)
	defer release()
	g := newLogGen(b, c, 3)
	g.apply("big", live)
	pl := g.pools["big"]
	for range live {
		g.create(pl, "", "")
	}
	for i := range rotated {
		old := pl.live[i%len(pl.live)]
		g.create(pl, old, "rotated: older than maxAge 1h0m0s")
		g.retire(pl, i%len(pl.live), "rotated: older than maxAge 1h0m0s", false)
	}
	for len(g.inflight) > 0 || len(g.deleting) > 0 {
		g.moveOn()
	}
	g.flush()
	var heap, rss, active float64
	for range b.N {
		heap0, rss0 := heapInUse(), residentSet(b)
		p, _, stop := startPlanner(b, c, Config{ID: "bench", SnapshotEvery: -1, SnapshotInterval: -1})
		v := p.poolView("big")
		if v.Active < live*9/10 {
			b.Fatalf("pool: %d active, want about %d", v.Active, live)
		}
		heap += float64(heapInUse()) - float64(heap0)
		rss += float64(residentSet(b)) - float64(rss0)
		active += float64(v.Active)
		runtime.KeepAlive(p)
		stop()
	}
	b.ReportMetric(heap/active*10_000, "heap-B/10k-live")
	b.ReportMetric(rss/active*10_000, "rss-B/10k-live")
	b.ReportMetric(active/float64(b.N), "live")
}

// residentSet returns the process's resident set size in bytes.
func residentSet(tb testing.TB) uint64 {
	tb.Helper()
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		tb.Skip("no /proc/self/statm: resident set not measured")
	}
	var size, res uint64
	if _, err := fmt.Sscan(string(b), &size, &res); err != nil {
		tb.Fatal(err)
	}
	return res * uint64(os.Getpagesize())
}

// logGen appends a realistic FLEET_EVENTS history directly, as the planner,
// the agents and the health service would have written it: pools applied,
// re-applied with another size and deleted, pool conditions, proxies
// through their whole lifecycle (requested, provisioning, running, ready,
// retiring, deleted), rotations and recycles (a replacement requested
// naming the proxy it replaces), bans, unhealthy spells, failures reported
// by agents (quota, terminated) and abandoned proxies. Its choices come
// from a seeded generator, so a seed gives one history. Every publish is
// asynchronous and every acknowledgement is checked.
type logGen struct {
	tb      testing.TB
	js      jetstream.JetStream
	rng     *rand.Rand
	now     time.Time
	pending []jetstream.PubAckFuture
	// n counts the events appended.
	n int
	// failed is set once an append failed (reported with Errorf, so a
	// generator may run on a goroutine of its own): it appends no more.
	failed bool

	pools map[string]*genPool
	names []string
	// inflight are proxies on their way up, deleting proxies retiring
	// whose agent did not report them deleted yet: later steps move them
	// on, so a history holds proxies in every state at any point.
	inflight []*genProxy
	deleting []string
}

// genProxy is a proxy on its way up: stage counts the events appended
// (1: requested, 2: provisioning, 3: running).
type genProxy struct {
	id, target string
	pool       *genPool
	stage      int
}

// genPool is one generated pool: its spec and its proxies by state.
type genPool struct {
	name     string
	revision int
	size     int
	deleted  bool
	targets  []string
	// live are its proxies that are up (ready or unhealthy), in order of
	// creation; unhealthy marks those that are not ready.
	live      []string
	unhealthy map[string]bool
	proxies   int
	// pending counts its proxies on their way up.
	pending int
	// finished are its deleted or abandoned proxies.
	finished []string
}

func newLogGen(tb testing.TB, c *bus.Conn, seed uint64) *logGen {
	return &logGen{tb: tb, js: c.JS, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		now: time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC), pools: map[string]*genPool{}}
}

// fail reports an append that failed.
func (g *logGen) fail(format string, args ...any) {
	g.tb.Errorf(format, args...)
	g.failed = true
}

// emit appends one event.
func (g *logGen) emit(aggregate, id, typ, msgID, source string, data any) {
	if g.failed {
		return
	}
	g.now = g.now.Add(time.Duration(1+g.rng.IntN(1000)) * time.Millisecond)
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(aggregate, typ), id, g.now, data)
	if err == nil {
		var body []byte
		body, err = env.MarshalJSON()
		msg := nats.NewMsg(events.SubjectOf(source, aggregate, id, typ))
		msg.Data = body
		msg.Header.Set(jetstream.MsgIDHeader, msgID)
		var f jetstream.PubAckFuture
		if err == nil {
			f, err = g.js.PublishMsgAsync(msg)
		}
		if err == nil {
			g.pending = append(g.pending, f)
		}
	}
	if err != nil {
		g.fail("append %s %s %s: %v", aggregate, id, typ, err)
		return
	}
	g.n++
	if len(g.pending) >= 2048 {
		g.flush()
	}
}

// flush waits for every outstanding acknowledgement.
func (g *logGen) flush() {
	for _, f := range g.pending {
		if g.failed {
			break
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			g.fail("append %s: %v", f.Msg().Subject, err)
		case <-time.After(30 * time.Second):
			g.fail("append %s: no acknowledgement", f.Msg().Subject)
		}
	}
	g.pending = g.pending[:0]
}

func (g *logGen) planner(id, typ string, n uint64, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.%s.%d.g%d", id, typ, n, g.n), events.SourcePlanner, data)
}

func (g *logGen) agentFact(id, target, typ string, n uint64, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.g%d", events.ProxyEventID(id, typ, n), g.n), events.AgentSource("local", target), data)
}

func (g *logGen) health(id, typ string, data any) {
	g.emit(events.AggregateProxy, id, typ, fmt.Sprintf("%s.%s.g%d", id, typ, g.n), events.SourceHealth, data)
}

// apply applies (or re-applies) pool name with size.
func (g *logGen) apply(name string, size int) {
	p := g.pools[name]
	if p == nil {
		p = &genPool{name: name, targets: []string{"t1", "t2", "t3"}, unhealthy: map[string]bool{}}
		g.pools[name] = p
		g.names = append(g.names, name)
	}
	p.revision++
	p.size, p.deleted = size, false
	spec := events.PoolSpec{Name: name, Provider: "local", Size: size, Port: 3128, MaxAge: events.Duration(time.Hour)}
	spec.Normalize()
	d := events.PoolAppliedData{Spec: spec.Public(), Revision: p.revision, SecretsDigest: events.PoolSecrets{}.Digest(nil)}
	g.emit(events.AggregatePool, name, events.PoolApplied, fmt.Sprintf("%s.applied.%d", name, p.revision), events.SourcePlanner, d)
}

// autoscale re-applies pool name with autoscale and has the planner
// scale it to size, so the pool wants size proxies as after apply.
func (g *logGen) autoscale(name string, size int) {
	p := g.pools[name]
	p.revision++
	spec := events.PoolSpec{Name: name, Provider: "local", Size: 1, Port: 3128, MaxAge: events.Duration(time.Hour),
		Autoscale: &events.Autoscale{Min: 1, Max: size + 3, TargetConnections: 10}}
	spec.Normalize()
	d := events.PoolAppliedData{Spec: spec.Public(), Revision: p.revision, SecretsDigest: events.PoolSecrets{}.Digest(nil)}
	g.emit(events.AggregatePool, name, events.PoolApplied, fmt.Sprintf("%s.applied.%d", name, p.revision), events.SourcePlanner, d)
	sd := events.PoolScaledData{Size: size, Previous: p.size, Reason: fmt.Sprintf("autoscale: %d connections for %d proxies", 10*size, size)}
	g.emit(events.AggregatePool, name, events.PoolScaled, fmt.Sprintf("%s.scaled.g%d", name, g.n), events.SourcePlanner, sd)
	p.size = size
}

// condition records one pool condition.
func (g *logGen) condition(name, status, reason string) {
	d := events.PoolConditionData{Type: events.ConditionReady, Status: status, Reason: reason, Message: reason}
	g.emit(events.AggregatePool, name, events.PoolCondition, fmt.Sprintf("%s.condition.g%d", name, g.n), events.SourcePlanner, d)
}

// create requests one new proxy of pool p, replacing replaces (with why)
// if set, and takes it up to ready now or, half the time, over later
// steps.
func (g *logGen) create(p *genPool, replaces, why string) {
	p.proxies++
	id := fmt.Sprintf("%s-%010d", p.name, p.proxies)
	target := p.targets[g.rng.IntN(len(p.targets))]
	g.planner(id, events.ProxyRequested, 1, events.ProxyRequestedData{
		ProxySpec:     events.ProxySpec{Pool: p.name, Entry: "local", Target: target, Instance: events.InstanceName(id), Revision: p.revision, Port: 3128},
		Replaces:      replaces,
		ReplaceReason: why,
	})
	x := &genProxy{id: id, target: target, pool: p, stage: 1}
	if g.rng.IntN(2) == 0 {
		for x.stage > 0 {
			g.advance(x)
		}
		return
	}
	p.pending++
	g.inflight = append(g.inflight, x)
}

// advance appends the next event of a proxy on its way up; stage 0 means
// it is up (or failed and retired).
func (g *logGen) advance(x *genProxy) {
	id, p := x.id, x.pool
	switch x.stage {
	case 1:
		g.agentFact(id, x.target, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: x.target,
			Instance: events.InstanceName(id), ProviderID: "pid-" + id, Attempt: 1})
		x.stage = 2
	case 2:
		if g.rng.IntN(20) == 0 {
			g.agentFact(id, x.target, events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "quota exceeded", Attempt: 1})
			g.planner(id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "failed: quota"})
			g.deleting = append(g.deleting, id)
			p.finished = append(p.finished, id)
			x.stage = 0
			return
		}
		g.agentFact(id, x.target, events.ProxyRunning, 1, events.ProxyRunningData{ProviderID: "pid-" + id,
			Address: fmt.Sprintf("127.0.0.1:%d", 20000+p.proxies%1000), Attempt: 1})
		x.stage = 3
	case 3:
		g.health(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:1", LatencyMS: int64(g.rng.IntN(50))})
		p.live = append(p.live, id)
		x.stage = 0
	}
}

// moveOn advances one proxy on its way up and reports one retiring proxy
// deleted, now and then.
func (g *logGen) moveOn() {
	for range 3 {
		if len(g.inflight) == 0 || g.rng.IntN(4) == 0 {
			break
		}
		i := g.rng.IntN(len(g.inflight))
		x := g.inflight[i]
		g.advance(x)
		if x.stage == 0 {
			x.pool.pending--
			g.inflight = append(g.inflight[:i], g.inflight[i+1:]...)
		}
	}
	if len(g.deleting) > 0 && g.rng.IntN(3) == 0 {
		i := g.rng.IntN(len(g.deleting))
		g.agentFact(g.deleting[i], "t1", events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		g.deleting = append(g.deleting[:i], g.deleting[i+1:]...)
	}
}

// retire takes the i-th live proxy of p through retiring to deleted (or
// abandoned, when skip).
func (g *logGen) retire(p *genPool, i int, reason string, skip bool) {
	id := p.live[i]
	p.live = append(p.live[:i], p.live[i+1:]...)
	delete(p.unhealthy, id)
	p.finished = append(p.finished, id)
	g.planner(id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: reason, SkipCleanup: skip})
	switch {
	case skip:
		g.planner(id, events.ProxyAbandoned, 1, events.ProxyAbandonedData{Reason: reason})
	case g.rng.IntN(2) == 0:
		g.deleting = append(g.deleting, id)
	default:
		g.agentFact(id, "t1", events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	}
}

// step appends one burst of activity.
func (g *logGen) step() {
	g.moveOn()
	if len(g.names) == 0 || g.rng.IntN(200) == 0 {
		g.apply(fmt.Sprintf("pool%d", len(g.names)), 5+g.rng.IntN(20))
		return
	}
	p := g.pools[g.names[g.rng.IntN(len(g.names))]]
	switch {
	case p.deleted:
		if g.rng.IntN(4) == 0 {
			g.apply(p.name, 3+g.rng.IntN(10))
		}
	case len(p.live)+p.pending < p.size:
		g.create(p, "", "")
	case len(p.live) > p.size:
		g.retire(p, 0, "scaled down", false)
	case len(p.live) == 0:
		// Every proxy it wants is on its way up.
	default:
		switch r := g.rng.IntN(100); {
		case r < 50: // rotation, surge first
			old := g.rng.IntN(len(p.live))
			oldID := p.live[old]
			g.create(p, oldID, "rotated: older than maxAge 1h0m0s")
			g.retire(p, old, "rotated: older than maxAge 1h0m0s", false)
		case r < 60: // ban: retired at once, replaced
			i := g.rng.IntN(len(p.live))
			g.create(p, p.live[i], "banned: 403")
			g.retire(p, i, "banned: 403", false)
		case r < 72: // an unhealthy spell
			id := p.live[g.rng.IntN(len(p.live))]
			if p.unhealthy[id] {
				g.health(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:1"})
				delete(p.unhealthy, id)
			} else {
				g.health(id, events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3})
				p.unhealthy[id] = true
			}
		case r < 78: // the backend lost or refused it
			i := g.rng.IntN(len(p.live))
			id := p.live[i]
			class := events.ClassTerminated
			if g.rng.IntN(2) == 0 {
				class = events.ClassQuota
			}
			g.agentFact(id, "t2", events.ProxyFailed, 1, events.ProxyFailedData{Class: class, Reason: "backend says " + class, Attempt: 1})
			g.retire(p, i, "failed: "+class, false)
		case r < 80: // abandoned by the operator
			g.retire(p, g.rng.IntN(len(p.live)), "deleted by operator, cleanup skipped", true)
		case r < 88:
			g.condition(p.name, events.ConditionFalse, events.ReasonNotEnoughReady)
			g.condition(p.name, events.ConditionTrue, events.ReasonEnoughReady)
		case r < 94: // scaled, by a re-apply or by autoscaling
			if size := max(1, p.size+g.rng.IntN(7)-3); p.revision%2 == 0 {
				g.apply(p.name, size)
			} else {
				g.autoscale(p.name, size)
			}
		case r < 95: // deleted: every proxy retires
			p.deleted = true
			p.revision++
			g.emit(events.AggregatePool, p.name, events.PoolDeleted, fmt.Sprintf("%s.deleted.%d", p.name, p.revision), events.SourcePlanner,
				events.PoolDeletedData{Revision: p.revision})
			for len(p.live) > 0 {
				g.retire(p, 0, "pool deleted", false)
			}
			for i := 0; i < len(g.inflight); i++ {
				if x := g.inflight[i]; x.pool == p {
					g.planner(x.id, events.ProxyRetiring, 1, events.ProxyRetiringData{Reason: "pool deleted"})
					g.deleting = append(g.deleting, x.id)
					p.finished = append(p.finished, x.id)
					g.inflight = append(g.inflight[:i], g.inflight[i+1:]...)
					i--
				}
			}
			p.pending = 0
		default: // a late observation of a finished proxy's agent
			if len(p.finished) > 0 {
				id := p.finished[g.rng.IntN(len(p.finished))]
				g.agentFact(id, "t1", events.ProxyDeleted, 9, events.ProxyDeletedData{Attempt: 9})
			}
		}
	}
}

// fill appends activity until at least n events were appended.
func (g *logGen) fill(n int) {
	for g.n < n && !g.failed {
		g.step()
	}
	g.flush()
	if g.failed {
		g.tb.FailNow()
	}
}

// streamEvents returns every message of FLEET_EVENTS from sequence from on,
// decoded as the planner's follow delivers them (leader terms and the
// fences that did not expire yet included).
func streamEvents(tb testing.TB, c *bus.Conn, from uint64) []bus.Event {
	tb.Helper()
	var out []bus.Event
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	store := bus.NewEventStore(c, "reader", nil)
	if err := store.Replay(ctx, from, func(e bus.Event) error {
		out = append(out, e)
		return nil
	}); err != nil {
		tb.Fatalf("replay: %v", err)
	}
	return out
}
