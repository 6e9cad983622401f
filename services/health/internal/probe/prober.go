// Package probe checks every proxy through itself: for each proxy of the
// fleet-proxies view that has an address and is running, ready, unhealthy
// or disabled, it sends a plain HTTP GET and a GET through a CONNECT tunnel
// to an echo endpoint via the proxy, on a jittered schedule with bounded
// concurrency. Counters (latency, failure streak, last error, egress IP,
// how many other proxies share that egress IP) go to the fleet-probes
// bucket; only transitions (running|unhealthy → ready, ready → unhealthy,
// and disabled → ready once the disabled proxy's time has passed) are
// appended to the event log. A running proxy that fails its probes stays
// running (it may still be booting); the planner's ready timeout deals with
// one that never gets ready. External proxies are probed with the
// credentials of their address, sealed to health with the pool's.
//
// Each proxy has its own due time; a [scheduler] starts the probe due
// earliest as soon as it is due and a slot is free.
//
// Health replicas split the proxies between them: a prober with a replica
// id probes only the proxies it owns among the live members of the
// fleet-health bucket (see members.go).
package probe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/projection"
)

// Config tunes a [Prober]. Zero values take the defaults noted.
type Config struct {
	// EchoURL answers the caller's IP as JSON {"ip":…} or plain text.
	EchoURL string
	// Interval from the end of one probe of a proxy to the start of the
	// next, jittered by ±20% (default 5s).
	Interval time.Duration
	// Timeout bounds each of the two checks of a probe (default 3s).
	Timeout time.Duration
	// Concurrency bounds probes in flight. Zero sizes it for the fleet
	// from the probes' mean duration (see [concurrencyFor]): 2 × proxies ×
	// mean ÷ (Interval + mean), within [32, 1024].
	Concurrency int
	// UnhealthyAfter is the failure streak that makes a proxy unhealthy
	// (default 3).
	UnhealthyAfter int
	// Key is health's curve (xkey) key: Run announces its public half in
	// fleet-probe-creds, and the planner seals each pool's probe password
	// to it. Replicas share one key. Nil makes a key that lives as long
	// as the process (tests).
	Key nkeys.KeyPair
	// Replica names this prober among the health replicas, which split
	// the proxies between them through the fleet-health bucket; see
	// [CheckReplica] for the form. Empty: the prober probes every proxy
	// and is no member.
	Replica string
	// Beat is how often a replica renews its membership and reads the
	// members (default [DefaultBeat]). It must stay below half of
	// bus.HealthMemberTTL.
	Beat time.Duration
	// Behind, when set, reports that the views are behind the event log
	// (projection.Projector.Behind). Meanwhile at most the minimum of 32
	// probes are in flight, whatever Concurrency says: in one process
	// with the projection, and on one machine with the NATS server, the
	// probes of a burst of new proxies would otherwise take the CPU the
	// views need to catch up, and the views are what makes those proxies
	// probeable. It is called often and must not block.
	Behind func() bool
}

func (c *Config) defaults() {
	if c.Interval <= 0 {
		c.Interval = 5 * time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = 3 * time.Second
	}
	if c.Concurrency < 0 {
		c.Concurrency = 0
	}
	if c.UnhealthyAfter <= 0 {
		c.UnhealthyAfter = 3
	}
	if c.Beat <= 0 {
		c.Beat = DefaultBeat
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
	// probe. Proxies sharing an egress have the same EgressIP: it names
	// their group.
	EgressIP string `json:"egressIP,omitempty"`
	// SharedEgress counts the other probed proxies whose last successful
	// probe egressed from EgressIP too.
	SharedEgress int `json:"sharedEgress,omitempty"`
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
	lateness    metric.Float64Histogram
	transitions metric.Int64Counter

	sched *scheduler

	// shard is the replica's membership; nil when it probes every proxy.
	shard *membership
	// stay keeps the membership key when Run ends (a test's crash).
	stay bool

	// mu guards proxies and egress. Lock order: mu, then the scheduler's.
	mu      sync.Mutex
	proxies map[string]*tracked // probeable proxies
	egress  *egressIndex
}

// tracked is the prober's state of one proxy. Guarded by Prober.mu.
type tracked struct {
	view    projection.Proxy
	streak  int
	lastOK  time.Time
	emitted string // "<kind>@<seq>" of the last transition appended
	// owned: this replica probes the proxy (always, without a shard).
	owned bool
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
	if cfg.Key == nil {
		var err error
		if cfg.Key, err = seal.NewKey(); err != nil {
			return nil, err
		}
	}
	if err := seal.CheckPublic(seal.Public(cfg.Key)); err != nil {
		return nil, fmt.Errorf("probe key: %w", err)
	}
	var shard *membership
	if cfg.Replica != "" {
		if err := CheckReplica(cfg.Replica); err != nil {
			return nil, err
		}
		if 2*cfg.Beat >= bus.HealthMemberTTL {
			return nil, fmt.Errorf("membership beat %s: want below half the membership TTL (%s)", cfg.Beat, bus.HealthMemberTTL)
		}
		log = log.With("replica", cfg.Replica)
		shard = &membership{self: cfg.Replica, beat: cfg.Beat, ttl: bus.HealthMemberTTL, started: time.Now().UTC(), log: log}
	}
	p := &Prober{
		conn:    c,
		store:   bus.NewEventStore(c, events.SourceHealth, log),
		cfg:     cfg,
		echo:    u,
		log:     log,
		tracer:  tracer,
		sched:   newScheduler(cfg.Interval, cfg.Concurrency),
		proxies: map[string]*tracked{},
		egress:  newEgressIndex(),
		shard:   shard,
	}
	p.probes, _ = meter.Int64Counter("proxyfleet_health_probes_total",
		metric.WithDescription("Probes through proxies, by outcome (ok, fail)."))
	p.latency, _ = meter.Float64Histogram("proxyfleet_health_probe_duration_seconds",
		metric.WithDescription("Latency of the plain HTTP check of a probe through a proxy, by outcome (ok, fail)."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
	p.lateness, _ = meter.Float64Histogram("proxyfleet_health_probe_lateness_seconds",
		metric.WithDescription("How long after its due time a probe started."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
	p.transitions, _ = meter.Int64Counter("proxyfleet_health_transitions_total",
		metric.WithDescription("Ready and unhealthy events appended, by kind."))
	return p, nil
}

// buckets are the KV handles a run uses, and what it builds on them.
type buckets struct {
	proxies, probes, pools, probeCreds jetstream.KeyValue
	records                            *recordWriter
	creds                              *credCache
}

// setUp binds the buckets, announces the probe key and joins the other
// replicas. A NATS error on the way (a cluster electing leaders, a node
// lost) is retried until ctx ends; a missing bucket is not: the topology
// was never created.
func (p *Prober) setUp(ctx context.Context) (buckets, error) {
	delay := 100 * time.Millisecond
	for {
		b, err := p.tryStart(ctx)
		if err == nil || ctx.Err() != nil {
			return b, nil
		}
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return b, err
		}
		p.log.Warn("prober start failed; retrying", "err", err, "in", delay.String())
		select {
		case <-ctx.Done():
			return b, nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

func (p *Prober) tryStart(ctx context.Context) (buckets, error) {
	var b buckets
	for _, x := range []struct {
		h    *jetstream.KeyValue
		name string
	}{{&b.proxies, bus.BucketProxies}, {&b.probes, bus.BucketProbes}, {&b.pools, bus.BucketPools}, {&b.probeCreds, bus.BucketProbeCreds}} {
		kv, err := p.conn.JS.KeyValue(ctx, x.name)
		if err != nil {
			return b, fmt.Errorf("bucket %s: %w", x.name, err)
		}
		*x.h = kv
	}
	b.records = newRecordWriter(p.conn.JS, b.probes, p.log)
	if err := p.announceKey(ctx, b.probeCreds); err != nil {
		return b, err
	}
	b.creds = newCredCache(b.pools, b.probeCreds, p.cfg.Key, p.log)
	if p.shard != nil {
		if err := p.join(ctx); err != nil {
			return b, err
		}
	}
	return b, nil
}

// Run probes until ctx ends, then waits for the probes in flight.
func (p *Prober) Run(ctx context.Context) error {
	b, err := p.setUp(ctx)
	if err != nil || ctx.Err() != nil {
		if p.shard != nil && p.shard.rev != 0 && !p.stay {
			// Stopped while joining: the others need not wait for the
			// key to expire.
			_ = p.shard.leave()
		}
		return err
	}
	if p.shard != nil {
		// Deferred first, so it runs last: once no probe is in flight.
		defer func() {
			if p.stay {
				return
			}
			if err := p.shard.leave(); err != nil {
				p.log.Warn("membership not deleted; the others take this replica's proxies when it expires", "err", err, "ttl", bus.HealthMemberTTL.String())
			}
		}()
	}
	sub, err := p.conn.NC.Subscribe(events.SuspectSubject, p.suspect)
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", events.SuspectSubject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	var wg sync.WaitGroup
	defer wg.Wait()
	// Whatever ends the watch below ends the goroutines it waits for.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if p.shard != nil {
		wg.Add(2)
		go func() {
			defer wg.Done()
			p.beat(ctx)
		}()
		go func() {
			defer wg.Done()
			p.watchPeers(ctx, b.probes)
		}()
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		b.records.run(ctx)
	}()
	go func() {
		defer wg.Done()
		p.sched.run(ctx, p.cfg.Behind, func(t ticket) { p.start(ctx, b, t, &wg) })
	}()
	delay := 100 * time.Millisecond
	for {
		w, err := b.proxies.WatchAll(ctx)
		if err == nil {
			delay = 100 * time.Millisecond
			known := map[string]bool{}
			err = p.loop(ctx, w, b, known, func() {})
			bus.StopWatch(w)
		}
		if err == nil || ctx.Err() != nil {
			return nil
		}
		// A cluster electing leaders (a node lost) fails the watch for
		// a while: the replica keeps its membership and watches again.
		p.log.Warn("watch of the proxies view failed; watching again", "err", err, "in", delay.String())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// loop follows one watch of the proxies view until ctx ends or the watch
// fails; loaded is called after each end of its initial values is handled.
func (p *Prober) loop(ctx context.Context, w jetstream.KeyWatcher, b buckets, known map[string]bool, loaded func()) error {
	// The fleet present when the watch starts is spread over a whole
	// interval, so a restart does not probe every proxy at once; a proxy
	// that appears later is probed within a quarter interval.
	within := p.cfg.Interval
	return bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
		if e == nil {
			// The view's current values are in: what is not among
			// them left while no watch was running, once the view
			// reads as not holding it. Their end can come before a
			// proxy whose value is rewritten meanwhile ([bus.Gone]):
			// such a proxy is kept, and its value follows.
			gone := func(id string) bool { return bus.Gone(ctx, b.proxies, id, p.log) }
			p.forgetUnknown(known, gone)
			p.dropStaleRecords(ctx, b, known, gone)
			within = p.cfg.Interval / 4
			loaded()
			return
		}
		p.observe(e, b.records, known, within)
	})
}

// observe follows one change of the proxies view. A proxy new to the
// prober is first probed at a random time within the given duration.
func (p *Prober) observe(e jetstream.KeyValueEntry, records *recordWriter, known map[string]bool, within time.Duration) {
	id := e.Key()
	if e.Operation() != jetstream.KeyValuePut {
		delete(known, id)
		p.forget(id)
		records.del(id)
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
		t = &tracked{view: v, owned: p.ownsLocked(id)}
		p.proxies[id] = t
		if t.owned {
			first := time.Duration(rand.Int64N(int64(within) + 1))
			p.sched.add(id, time.Now().Add(first))
		}
		return
	}
	if t.view.Address != v.Address {
		// Another instance answers now: earlier results say nothing of it.
		t.streak, t.lastOK = 0, time.Time{}
		p.egress.set(id, "")
	}
	t.view = v
}

// suspect probes proxy id at once if this replica probes it: a gateway
// saw a request through it fail (the message on events.SuspectSubject).
// Other replicas ignore it, and so does a proxy whose probe is in flight.
func (p *Prober) suspect(msg *nats.Msg) {
	var s events.Suspect
	if err := json.Unmarshal(msg.Data, &s); err != nil || s.ID == "" {
		p.log.Debug("suspect report does not decode; ignored", "subject", msg.Subject)
		return
	}
	p.mu.Lock()
	t := p.proxies[s.ID]
	owned := t != nil && t.owned
	p.mu.Unlock()
	if owned && p.sched.expedite(s.ID, time.Now()) {
		p.log.Debug("suspect proxy probed at once", "proxy", s.ID, "reason", s.Reason)
	}
}

func (p *Prober) forget(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.forgetLocked(id)
}

func (p *Prober) forgetLocked(id string) {
	delete(p.proxies, id)
	p.egress.set(id, "")
	p.sched.remove(id)
}

// forgetUnknown stops probing the proxies that are not in known and are
// gone from the view.
func (p *Prober) forgetUnknown(known map[string]bool, gone func(id string) bool) {
	p.mu.Lock()
	var unknown []string
	for id := range p.proxies {
		if !known[id] {
			unknown = append(unknown, id)
		}
	}
	p.mu.Unlock()
	for _, id := range unknown {
		if gone(id) {
			p.forget(id)
		}
	}
}

// dropStaleRecords removes probe records of proxies that left the view
// while no prober was watching.
func (p *Prober) dropStaleRecords(ctx context.Context, b buckets, known map[string]bool, gone func(id string) bool) {
	keys, err := b.probes.ListKeys(ctx)
	if err != nil {
		return
	}
	for k := range keys.Keys() {
		if !known[k] && gone(k) {
			b.records.del(k)
		}
	}
}

// start launches the probe of the scheduler's ticket t; the probe hands
// the ticket back with the proxy's next due time when it ends.
func (p *Prober) start(ctx context.Context, b buckets, t ticket, wg *sync.WaitGroup) {
	p.lateness.Record(ctx, t.late.Seconds())
	begin := time.Now()
	p.mu.Lock()
	tr := p.proxies[t.id]
	var view projection.Proxy
	if tr != nil {
		view = tr.view
	}
	p.mu.Unlock()
	if tr == nil || !tr.owned {
		// Forgotten, or handed to another replica, between the
		// scheduler's pop and now.
		p.sched.done(t, begin.Add(jitter(p.cfg.Interval)), 0)
		return
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		p.probe(ctx, b, t.id, view)
		end := time.Now()
		p.sched.done(t, end.Add(jitter(p.cfg.Interval)), end.Sub(begin))
	}()
}

// probe checks one proxy, records the result and appends a transition when
// the proxy's state changes.
func (p *Prober) probe(runCtx context.Context, b buckets, id string, view projection.Proxy) {
	// One budget for the whole probe, KV calls included, so a stuck call
	// cannot keep this proxy from ever being probed again.
	ctx, cancel := context.WithTimeout(runCtx, 2*p.cfg.Timeout+10*time.Second)
	defer cancel()
	creds := b.creds.credentials(ctx, view)
	res := Check(ctx, view.Address, creds, p.echo, p.cfg.Timeout)
	if runCtx.Err() != nil {
		return // shutting down: the result says nothing about the proxy
	}
	now := time.Now().UTC()
	result := "ok"
	if !res.OK() {
		result = "fail"
	}
	outcome := metric.WithAttributes(attribute.String("outcome", result))
	p.probes.Add(ctx, 1, outcome)
	p.latency.Record(ctx, res.HTTPLatency.Seconds(), outcome)

	p.mu.Lock()
	t := p.proxies[id]
	if t == nil || t.view.Address != view.Address || !t.owned || (p.shard != nil && !p.shard.current()) {
		// Gone, retired or replaced while we probed; or handed to
		// another replica, or this replica's membership is too old to
		// be sure it still owns the proxy: the owner records it.
		p.mu.Unlock()
		return
	}
	if res.OK() {
		t.streak, t.lastOK = 0, now
		p.egress.set(id, res.EgressIP)
	} else {
		t.streak++
	}
	// Decide on the state the view holds now, not the one we started from.
	cur := t.view
	var kind string
	var data any
	switch {
	case res.OK() && (cur.State == events.ProxyRunning || cur.State == events.ProxyUnhealthy || returns(cur, now)):
		kind = events.ProxyReady
		data = events.ProxyReadyData{Address: cur.Address, LatencyMS: res.HTTPLatency.Milliseconds(), EgressIP: res.EgressIP}
	case !res.OK() && t.streak >= p.cfg.UnhealthyAfter && cur.State == events.ProxyReady:
		// Only a proxy that was ready turns unhealthy. One still running
		// has not served yet (a cloud image installing and starting
		// Squid): its failures stay in fleet-probes, and the planner fails
		// it when it is not ready after its --ready-timeout.
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
		EgressIP: p.egress.ip(id), SharedEgress: p.egress.others(id),
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
	// Queued under mu: a removal of the proxy, which forgets it under mu
	// first, queues the record's delete after this put.
	body, _ := json.Marshal(rec)
	b.records.put(id, body)
	p.mu.Unlock()

	if kind != "" {
		msgID := events.ProxyEventID(id, kind, cur.Seq)
		// A transition may come days after the operator request that asked
		// for the proxy: it starts a trace of its own, linked to the
		// request's (carried by the requested event), rather than being
		// appended to it.
		var request trace.SpanContext
		if req, err := p.store.LastOf(ctx, events.AggregateProxy, id, events.ProxyRequested); err == nil && req != nil {
			request = trace.SpanContextFromContext(telemetry.Extract(ctx, req.Header))
		}
		opts := append(telemetry.NewRootLinkedTo(request, telemetry.LinkRequested), trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(telemetry.MessagingAttrs(telemetry.OpSend, events.SubjectOf(events.SourceHealth, events.AggregateProxy, id, kind), "")...),
			trace.WithAttributes(attribute.String("proxy", id), attribute.String("pool", cur.Pool), attribute.String("event", kind), telemetry.AttrMessageID.String(msgID)))
		sctx, span := p.tracer.Start(ctx, "health.transition", opts...)
		_, err := p.store.Append(sctx, events.AggregateProxy, id, kind, msgID, data, nil)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, "append "+kind+" failed")
			p.log.WarnContext(sctx, "append transition; will retry on the next probe", "proxy", id, "event", kind, "err", err)
		} else {
			p.transitions.Add(ctx, 1, metric.WithAttributes(attribute.String("kind", kind)))
			p.log.InfoContext(sctx, "proxy "+kind, "proxy", id, "pool", cur.Pool, "address", cur.Address, "streak", rec.Streak, "err", rec.LastError)
			p.mu.Lock()
			if t := p.proxies[id]; t != nil {
				t.emitted = mark
			}
			p.mu.Unlock()
		}
		span.End()
	}
}

// returns reports whether a good probe at now returns v to service: v is
// a disabled (external) proxy whose time out of service has passed. A
// disabled proxy stays disabled before its time, and on a failed probe.
func returns(v projection.Proxy, now time.Time) bool {
	return v.State == events.ProxyDisabled && !now.Before(v.DisabledUntil)
}

// jitter returns d scaled by a random factor in [0.8, 1.2).
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// announceKey writes health's public key into fleet-probe-creds, where the
// planner reads it to seal the probe passwords, unless it is there already.
func (p *Prober) announceKey(ctx context.Context, kv jetstream.KeyValue) error {
	pub := seal.Public(p.cfg.Key)
	e, err := kv.Get(ctx, events.ProbeRecipientKey)
	if err == nil && string(e.Value()) == pub {
		return nil
	}
	if err == nil {
		p.log.Warn("another probe key was announced (a health replica with another --probe-key-file?): replacing it; replicas must share one key", "was", string(e.Value()), "now", pub)
	}
	if _, err := kv.Put(ctx, events.ProbeRecipientKey, []byte(pub)); err != nil {
		return fmt.Errorf("announce the probe key in %s: %w", bus.BucketProbeCreds, err)
	}
	p.log.Info("probe key announced", "xkey", pub)
	return nil
}
