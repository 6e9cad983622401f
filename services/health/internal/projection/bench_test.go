package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// BenchmarkRebuildViews replays a log of 100k events of a fleet of 10k
// proxies (see fleetLog) into the views, as health --rebuild-views does,
// and in the same iteration reads the same log with a bare ordered
// consumer that does nothing per message: rebuild/bare is the rebuild's
// throughput as a fraction of the bare read's.
func BenchmarkRebuildViews(b *testing.B) {
	ctx := context.Background()
	c := bustest.Start(b)
	last := publishLog(b, ctx, c, fleetLog(1, 100_000, 10_000))
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		b.Fatal(err)
	}
	var bare, rebuild, bareCPU, rebuildCPU time.Duration
	for b.Loop() {
		t0, c0 := time.Now(), cpuTime(b)
		readAll(b, ctx, st, last)
		bare += time.Since(t0)
		bareCPU += cpuTime(b) - c0
		t0, c0 = time.Now(), cpuTime(b)
		if err := projection.Replay(ctx, c, nil); err != nil {
			b.Fatal(err)
		}
		rebuild += time.Since(t0)
		rebuildCPU += cpuTime(b) - c0
	}
	kv, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		b.Fatal(err)
	}
	if s, err := kv.Status(ctx); err != nil || s.Values() < 5000 {
		b.Fatalf("fleet-proxies after the rebuild: %v, %v; want thousands of proxies", s, err)
	}
	n := float64(last) * float64(b.N)
	b.ReportMetric(n/bare.Seconds(), "bare-events/s")
	b.ReportMetric(n/rebuild.Seconds(), "rebuild-events/s")
	b.ReportMetric(bare.Seconds()/rebuild.Seconds(), "rebuild/bare")
	// CPU time (this process: the client and the embedded server) per
	// event: what the rebuild costs apart from how busy the machine is.
	b.ReportMetric(float64(bareCPU.Nanoseconds())/n/1e3, "bare-cpu-µs/event")
	b.ReportMetric(float64(rebuildCPU.Nanoseconds())/n/1e3, "rebuild-cpu-µs/event")
}

// cpuTime is the CPU time this process used so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// readAll reads the stream up to last with an ordered consumer, counting.
func readAll(b *testing.B, ctx context.Context, st jetstream.Stream, last uint64) {
	b.Helper()
	oc, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	it, err := oc.Messages()
	if err != nil {
		b.Fatal(err)
	}
	defer it.Stop()
	for range last {
		if _, err := it.Next(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLiveLag runs a projector following a fleet of 10k ready
// proxies, then appends a burst of one event per proxy (all unhealthy, or
// all ready again) and waits until the view of the proxy of the last event
// shows it. burst-ms is from the first append to that; lag-ms from the
// last event being stored to that.
func BenchmarkLiveLag(b *testing.B) {
	const fleet = 10_000
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := bustest.Start(b)
	ids := make([]string, fleet)
	var setup []logMsg
	for i := range ids {
		ids[i] = fmt.Sprintf("live-%05d", i)
	}
	for _, kind := range []string{events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady} {
		for i, id := range ids {
			var d any
			switch kind {
			case events.ProxyRequested:
				d = events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "live", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: 3128}}
			case events.ProxyProvisioning:
				d = events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(id), ProviderID: "vm-" + id, Attempt: 1}
			case events.ProxyRunning:
				d = events.ProxyRunningData{Address: fmt.Sprintf("10.0.%d.%d:3128", i/250, i%250), Attempt: 1}
			case events.ProxyReady:
				d = events.ProxyReadyData{Address: fmt.Sprintf("10.0.%d.%d:3128", i/250, i%250), LatencyMS: 3, EgressIP: "192.0.2.1"}
			}
			setup = append(setup, proxyMsg(id, kind, 1, time.Unix(0, 0), d))
		}
	}
	last := publishLog(b, ctx, c, setup)

	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		if err := projection.New(c, nil, nil).Run(ctx); err != nil {
			b.Error(err)
		}
	})
	kv, err := c.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		b.Fatal(err)
	}
	waitSeq(b, ctx, kv, ids[fleet-1], last, nil)

	var burst, lag time.Duration
	for i := 0; b.Loop(); i++ {
		kind, d := events.ProxyUnhealthy, any(events.ProxyUnhealthyData{Reason: fmt.Sprintf("probe %d failed", i), Streak: 3})
		if i%2 == 1 {
			kind, d = events.ProxyReady, events.ProxyReadyData{Address: "10.0.0.1:3128", LatencyMS: int64(i), EgressIP: "192.0.2.1"}
		}
		msgs := make([]logMsg, fleet)
		for j, id := range ids {
			msgs[j] = proxyMsg(id, kind, uint64(i+2), time.Unix(int64(i), 0), d)
		}
		w, err := kv.Watch(ctx, ids[fleet-1], jetstream.UpdatesOnly())
		if err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		seq := publishLog(b, ctx, c, msgs)
		stored := time.Now()
		done := waitSeq(b, ctx, kv, ids[fleet-1], seq, w)
		burst += done.Sub(t0)
		lag += done.Sub(stored)
	}
	b.ReportMetric(float64(burst.Milliseconds())/float64(b.N), "burst-ms")
	b.ReportMetric(float64(lag.Milliseconds())/float64(b.N), "lag-ms")
	b.ReportMetric(float64(fleet*b.N)/burst.Seconds(), "burst-events/s")
}

// proxyMsg is the event kind of proxy id from its writer.
func proxyMsg(id, kind string, n uint64, at time.Time, data any) logMsg {
	msgID := events.ProxyEventID(id, kind, n)
	source := bustest.Source(events.AggregateProxy, kind)
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(events.AggregateProxy, kind), id, at, data)
	if err != nil {
		panic(err)
	}
	body, err := env.MarshalJSON()
	if err != nil {
		panic(err)
	}
	return logMsg{subject: events.SubjectOf(source, events.AggregateProxy, id, kind), msgID: msgID, data: body}
}

// waitSeq waits until proxy id's view records seq or later, following the
// watcher w when given, and returns when it saw it.
func waitSeq(b *testing.B, ctx context.Context, kv jetstream.KeyValue, id string, seq uint64, w jetstream.KeyWatcher) time.Time {
	b.Helper()
	if w == nil {
		var err error
		if w, err = kv.Watch(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
	defer func() { _ = w.Stop() }()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		select {
		case e := <-w.Updates():
			if e == nil {
				continue // the end of the initial values
			}
			var v projection.Proxy
			if err := json.Unmarshal(e.Value(), &v); err == nil && v.Seq >= seq {
				return time.Now()
			}
		case <-ctx.Done():
			b.Fatalf("proxy %s never reached seq %d", id, seq)
		}
	}
}
