// Package probe checks every proxy through itself: for each proxy of the
// fleet-proxies view that has an address and is running, ready or
// unhealthy, it sends a plain HTTP GET and a GET through a CONNECT tunnel to
// an echo endpoint via the proxy, on a jittered schedule with bounded
// concurrency. Counters (latency, failure streak, last error, egress IP,
// proxies sharing that egress IP) go to the fleet-probes bucket; only
// transitions (running|unhealthy → ready, running|ready → unhealthy) are
// appended to the event log.
package probe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/projection"
)

// Config tunes a [Prober]. Zero values take the defaults noted.
type Config struct {
	// EchoURL answers the caller's IP as JSON {"ip":…} or plain text.
	EchoURL string
	// Interval between two probes of one proxy, jittered by ±20% (default 5s).
	Interval time.Duration
	// Timeout bounds each of the two checks of a probe (default 3s).
	Timeout time.Duration
	// Concurrency bounds probes in flight (default 32).
	Concurrency int
	// UnhealthyAfter is the failure streak that makes a proxy unhealthy
	// (default 3).
	UnhealthyAfter int
}

func (c *Config) defaults() {
	if c.Interval <= 0 {
		c.Interval = 5 * time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = 3 * time.Second
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 32
	}
	if c.UnhealthyAfter <= 0 {
		c.UnhealthyAfter = 3
	}
}

// Record is the fleet-probes value of one proxy (key: the proxy id). It is
// operational data, not part of the views rebuilt from the log.
type Record struct {
	ID               string `json:"id"`
	Pool             string `json:"pool"`
	Address          string `json:"address"`
	State            string `json:"state"`
	OK               bool   `json:"ok"`
	HTTPOK           bool   `json:"httpOK"`
	ConnectOK        bool   `json:"connectOK"`
	LatencyMS        int64  `json:"latencyMs"`
	ConnectLatencyMS int64  `json:"connectLatencyMs"`
	// EgressIP is the address the echo endpoint saw on the last successful
	// probe.
	EgressIP string `json:"egressIP,omitempty"`
	// SharedEgress lists the other probed proxies that egress from EgressIP.
	SharedEgress []string `json:"sharedEgress,omitempty"`
	// Streak counts consecutive failed probes.
	Streak    int        `json:"streak"`
	LastError string     `json:"lastError,omitempty"`
	LastOKAt  *time.Time `json:"lastOKAt,omitempty"`
	CheckedAt time.Time  `json:"checkedAt"`
}

// Prober probes the fleet. Create it with [New] and call [Prober.Run].
type Prober struct {
	conn  *bus.Conn
	store *bus.EventStore
	cfg   Config
	echo  *url.URL
	log   *slog.Logger

	tracer      trace.Tracer
	probes      metric.Int64Counter
	latency     metric.Float64Histogram
	transitions metric.Int64Counter

	mu       sync.Mutex
	proxies  map[string]*tracked // probeable proxies
	egressOf map[string]string   // proxy id → last egress IP
	byEgress map[string]map[string]bool
}

// tracked is the prober's state of one proxy. Guarded by Prober.mu.
type tracked struct {
	view    projection.Proxy
	due     time.Time
	busy    bool
	streak  int
	lastOK  time.Time
	emitted string // "<kind>@<seq>" of the last transition appended
}

// New returns a prober appending its observations through c. log and tel
// may be nil.
func New(c *bus.Conn, cfg Config, log *slog.Logger, tel *telemetry.Telemetry) (*Prober, error) {
	cfg.defaults()
	u, err := url.Parse(cfg.EchoURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("echo URL %q: want an absolute http:// or https:// URL", cfg.EchoURL)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "probe")
	tracer, meter := trace.Tracer(tracenoop.NewTracerProvider().Tracer("")), metric.Meter(metricnoop.NewMeterProvider().Meter(""))
	if tel != nil {
		tracer, meter = tel.Tracer, tel.Meter
	}
	p := &Prober{
		conn:     c,
		store:    bus.NewEventStore(c, events.SourceHealth, log),
		cfg:      cfg,
		echo:     u,
		log:      log,
		tracer:   tracer,
		proxies:  map[string]*tracked{},
		egressOf: map[string]string{},
		byEgress: map[string]map[string]bool{},
	}
	p.probes, _ = meter.Int64Counter("proxyfleet.health.probes",
		metric.WithDescription("probes through proxies, by result (ok, fail)"))
	p.latency, _ = meter.Float64Histogram("proxyfleet.health.probe.latency",
		metric.WithDescription("latency of the plain HTTP check through a proxy"), metric.WithUnit("ms"))
	p.transitions, _ = meter.Int64Counter("proxyfleet.health.transitions",
		metric.WithDescription("ready and unhealthy events appended, by kind"))
	return p, nil
}

// buckets are the KV handles a run uses.
type buckets struct {
	proxies, probes, pools, secrets jetstream.KeyValue
}

// Run probes until ctx ends, then waits for the probes in flight.
func (p *Prober) Run(ctx context.Context) error {
	var b buckets
	for _, x := range []struct {
		h    *jetstream.KeyValue
		name string
	}{{&b.proxies, bus.BucketProxies}, {&b.probes, bus.BucketProbes}, {&b.pools, bus.BucketPools}, {&b.secrets, bus.BucketSecrets}} {
		kv, err := p.conn.JS.KeyValue(ctx, x.name)
		if err != nil {
			return fmt.Errorf("bucket %s: %w", x.name, err)
		}
		*x.h = kv
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	sem := make(chan struct{}, p.cfg.Concurrency)
	tick := time.NewTicker(min(max(p.cfg.Interval/10, 10*time.Millisecond), 500*time.Millisecond))
	defer tick.Stop()
	for {
		w, err := b.proxies.WatchAll(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("watch %s: %w", bus.BucketProxies, err)
		}
		known := map[string]bool{}
		err = p.loop(ctx, w, b, known, tick.C, sem, &wg)
		_ = w.Stop()
		if err == nil || ctx.Err() != nil {
			return nil
		}
		p.log.Warn("watch of the proxies view ended; restarting it", "err", err)
	}
}

func (p *Prober) loop(ctx context.Context, w jetstream.KeyWatcher, b buckets, known map[string]bool, tick <-chan time.Time, sem chan struct{}, wg *sync.WaitGroup) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("watcher closed")
			}
			if e == nil {
				p.dropStaleRecords(ctx, b.probes, known)
				continue
			}
			p.observe(ctx, e, b.probes, known)
		case <-tick:
			p.dispatch(ctx, b, sem, wg)
		}
	}
}

// observe follows one change of the proxies view.
func (p *Prober) observe(ctx context.Context, e jetstream.KeyValueEntry, probes jetstream.KeyValue, known map[string]bool) {
	id := e.Key()
	if e.Operation() != jetstream.KeyValuePut {
		delete(known, id)
		p.forget(id)
		if err := probes.Delete(ctx, id); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) && ctx.Err() == nil {
			p.log.Warn("delete probe record", "proxy", id, "err", err)
		}
		return
	}
	known[id] = true
	var v projection.Proxy
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		p.log.Error("proxies view value does not decode; not probing it", "proxy", id, "err", err)
		p.forget(id)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t := p.proxies[id]
	if !v.Probeable() {
		// Retiring, failed, provisioning again…: stop probing. The probe
		// record stays until the proxy is gone.
		if t != nil {
			p.forgetLocked(id)
		}
		return
	}
	if t == nil {
		first := time.Duration(rand.Int64N(int64(p.cfg.Interval/4) + 1))
		p.proxies[id] = &tracked{view: v, due: time.Now().Add(first)}
		return
	}
	if t.view.Address != v.Address {
		// Another instance answers now: earlier results say nothing of it.
		t.streak, t.lastOK = 0, time.Time{}
		p.setEgressLocked(id, "")
	}
	t.view = v
}

func (p *Prober) forget(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.forgetLocked(id)
}

func (p *Prober) forgetLocked(id string) {
	delete(p.proxies, id)
	p.setEgressLocked(id, "")
}

func (p *Prober) setEgressLocked(id, ip string) {
	if old := p.egressOf[id]; old != "" {
		delete(p.byEgress[old], id)
		if len(p.byEgress[old]) == 0 {
			delete(p.byEgress, old)
		}
		delete(p.egressOf, id)
	}
	if ip == "" {
		return
	}
	p.egressOf[id] = ip
	if p.byEgress[ip] == nil {
		p.byEgress[ip] = map[string]bool{}
	}
	p.byEgress[ip][id] = true
}

// sharedLocked lists the other proxies egressing from id's address.
func (p *Prober) sharedLocked(id string) []string {
	ip := p.egressOf[id]
	if ip == "" || len(p.byEgress[ip]) < 2 {
		return nil
	}
	var out []string
	for other := range p.byEgress[ip] {
		if other != id {
			out = append(out, other)
		}
	}
	slices.Sort(out)
	return out
}

// dropStaleRecords removes probe records of proxies that left the view
// while no prober was watching.
func (p *Prober) dropStaleRecords(ctx context.Context, probes jetstream.KeyValue, known map[string]bool) {
	keys, err := probes.ListKeys(ctx)
	if err != nil {
		return
	}
	for k := range keys.Keys() {
		if !known[k] {
			_ = probes.Delete(ctx, k)
		}
	}
}

// dispatch starts the probes that are due, as far as free slots allow.
func (p *Prober) dispatch(ctx context.Context, b buckets, sem chan struct{}, wg *sync.WaitGroup) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, t := range p.proxies {
		if t.busy || now.Before(t.due) {
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			return // every slot is busy; the rest wait for the next tick
		}
		t.busy = true
		view := t.view
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			p.probe(ctx, b, id, view)
		}()
	}
}

// probe checks one proxy, records the result and appends a transition when
// the proxy's state changes.
func (p *Prober) probe(runCtx context.Context, b buckets, id string, view projection.Proxy) {
	// One budget for the whole probe, KV calls included, so a stuck call
	// cannot keep this proxy from ever being probed again.
	ctx, cancel := context.WithTimeout(runCtx, 2*p.cfg.Timeout+10*time.Second)
	defer cancel()
	creds := p.credentials(ctx, b, view)
	res := Check(ctx, view.Address, creds, p.echo, p.cfg.Timeout)
	if runCtx.Err() != nil {
		return // shutting down: the result says nothing about the proxy
	}
	now := time.Now().UTC()
	result := "ok"
	if !res.OK() {
		result = "fail"
	}
	p.probes.Add(ctx, 1, metric.WithAttributes(attribute.String("result", result)))
	if res.HTTP == nil {
		p.latency.Record(ctx, float64(res.HTTPLatency.Microseconds())/1000)
	}

	p.mu.Lock()
	t := p.proxies[id]
	if t == nil || t.view.Address != view.Address {
		// Gone, retired or replaced while we probed.
		if t != nil {
			t.busy = false
		}
		p.mu.Unlock()
		return
	}
	t.busy = false
	t.due = time.Now().Add(jitter(p.cfg.Interval))
	if res.OK() {
		t.streak, t.lastOK = 0, now
		p.setEgressLocked(id, res.EgressIP)
	} else {
		t.streak++
	}
	// Decide on the state the view holds now, not the one we started from.
	cur := t.view
	var kind string
	var data any
	switch {
	case res.OK() && (cur.State == events.ProxyRunning || cur.State == events.ProxyUnhealthy):
		kind = events.ProxyReady
		data = events.ProxyReadyData{Address: cur.Address, LatencyMS: res.HTTPLatency.Milliseconds(), EgressIP: res.EgressIP}
	case !res.OK() && t.streak >= p.cfg.UnhealthyAfter && (cur.State == events.ProxyRunning || cur.State == events.ProxyReady):
		kind = events.ProxyUnhealthy
		data = events.ProxyUnhealthyData{Reason: res.Err().Error(), Streak: t.streak}
	}
	mark := fmt.Sprintf("%s@%d", kind, cur.Seq)
	if kind != "" && t.emitted == mark {
		kind = "" // appended already; the view has not caught up yet
	}
	rec := Record{
		ID: id, Pool: cur.Pool, Address: cur.Address, State: cur.State,
		OK: res.OK(), HTTPOK: res.HTTP == nil, ConnectOK: res.Connect == nil,
		LatencyMS: res.HTTPLatency.Milliseconds(), ConnectLatencyMS: res.ConnectLatency.Milliseconds(),
		EgressIP: p.egressOf[id], SharedEgress: p.sharedLocked(id),
		Streak: t.streak, CheckedAt: now,
	}
	if err := res.Err(); err != nil {
		rec.LastError = err.Error()
	}
	p.log.Debug("probed", "proxy", id, "address", cur.Address, "state", cur.State, "ok", rec.OK, "streak", rec.Streak, "err", rec.LastError)
	if !t.lastOK.IsZero() {
		at := t.lastOK
		rec.LastOKAt = &at
	}
	p.mu.Unlock()

	if kind != "" {
		msgID := events.ProxyEventID(id, kind, cur.Seq)
		// The transition continues the trace of the operator request that
		// asked for the proxy, carried by its requested event.
		tctx := ctx
		if req, err := p.store.LastOf(ctx, events.AggregateProxy, id, events.ProxyRequested); err == nil && req != nil {
			tctx = telemetry.Extract(ctx, req.Header)
		}
		sctx, span := p.tracer.Start(tctx, "health.transition", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(attribute.String("proxy", id), attribute.String("pool", cur.Pool), attribute.String("event", kind)))
		_, err := p.store.Append(sctx, events.AggregateProxy, id, kind, msgID, data, nil)
		if err != nil {
			span.RecordError(err)
		}
		span.End()
		if err != nil {
			p.log.Warn("append transition; will retry on the next probe", "proxy", id, "event", kind, "err", err)
		} else {
			p.transitions.Add(ctx, 1, metric.WithAttributes(attribute.String("kind", kind)))
			p.log.Info("proxy "+kind, "proxy", id, "pool", cur.Pool, "address", cur.Address, "streak", rec.Streak, "err", rec.LastError)
			p.mu.Lock()
			if t := p.proxies[id]; t != nil {
				t.emitted = mark
			}
			p.mu.Unlock()
		}
	}
	body, _ := json.Marshal(rec)
	if _, err := b.probes.Put(ctx, id, body); err != nil && ctx.Err() == nil {
		p.log.Warn("write probe record", "proxy", id, "err", err)
	}
}

// credentials returns the basic-auth pair of the proxy's pool, or nil when
// the pool has no auth. The username comes from the requested event (or the
// pool spec), the password from fleet-secrets.
func (p *Prober) credentials(ctx context.Context, b buckets, v projection.Proxy) *Credentials {
	user := v.Username
	if user == "" {
		if e, err := b.pools.Get(ctx, v.Pool); err == nil {
			var pool projection.Pool
			if json.Unmarshal(e.Value(), &pool) == nil && pool.Spec.Auth != nil {
				user = pool.Spec.Auth.Username
			}
		}
	}
	if user == "" {
		return nil
	}
	c := &Credentials{Username: user}
	e, err := b.secrets.Get(ctx, v.Pool)
	if err != nil {
		p.log.Warn("no password for the pool's proxies; probing without it", "pool", v.Pool, "err", err)
		return c
	}
	var s events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &s); err != nil {
		p.log.Warn("pool secrets do not decode; probing without a password", "pool", v.Pool)
		return c
	}
	c.Password = s.Password
	return c
}

// jitter returns d scaled by a random factor in [0.8, 1.2).
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
