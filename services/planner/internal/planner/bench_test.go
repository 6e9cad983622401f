package planner

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
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
	c, err := bus.Connect(ctx, bus.Config{DataDir: tb.TempDir(), Listen: "127.0.0.1:-1", Name: tb.Name()}, nil)
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
	rev, err := kv.Create(ctx, leaderKey, []byte("bench"))
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
				if r, err := kv.Update(hctx, leaderKey, []byte("bench"), rev); err == nil {
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
	p, err := New(conn, cfg, nil, nil)
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
			_, err := conn.NC.Request(events.APISubject("pool", "list"), []byte(`{}`), 10*time.Second)
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
	snapSeq, err := p.writeSnapshot(context.Background())
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
			if p.snapLoaded != 0 {
				b.Fatalf("started from a snapshot at %d", p.snapLoaded)
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
			if p.snapLoaded != snapSeq {
				b.Fatalf("started from snapshot %d, want %d", p.snapLoaded, snapSeq)
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
