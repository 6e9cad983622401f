// Package planner turns operator intent into events and backend commands.
//
// It serves the operator API (the "fleet-planner" micro service on
// fleet.api.pool.* and fleet.api.proxy.*), keeps a projection of
// FLEET_EVENTS (rebuilt by replay at start, then followed live, O(1) per
// event), and, on the one replica holding the leader lease in KV
// fleet-planner, reconciles every pool to its spec: it places missing
// proxies on the live targets agents announce in fleet-agents, retires
// excess and failed ones, rotates proxies older than the pool's maxAge
// (surge first), re-issues commands that got stuck, and collects garbage:
// it asks agents for their inventories, deletes marked instances no live
// proxy owns and fails proxies whose instance vanished.
//
// Every decision is appended with the aggregate's expected last sequence,
// so two deciders never both win; reconciler decisions are also fenced by
// the leader's term (fence.go), so a leader paused past its lease cannot
// append one after another replica took over; commands carry deterministic
// Nats-Msg-Ids, so re-publishing after a crash is a no-op inside the
// duplicate window.
package planner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/planner/internal/apiserver"
	"proxyfleet/services/planner/internal/decide"
)

// Source is the CloudEvents source of everything the planner writes.
const Source = events.SourcePlanner

// leaderKey is the fleet-planner key of the leader lease.
const leaderKey = "leader"

// Config tunes a [Planner]. Zero values take the defaults noted.
type Config struct {
	// ID names this replica in the leader lease (required).
	ID string
	// ReconcileInterval is the period of reconcile rounds (default 2s);
	// relevant events also start a round.
	ReconcileInterval time.Duration
	// CreateTimeout is how long a proxy may stay requested before its create
	// is re-issued with the next attempt (default 3m).
	CreateTimeout time.Duration
	// ProvisionTimeout is how long a proxy may stay provisioning before it is
	// recorded as failed with class timeout (default 15m).
	ProvisionTimeout time.Duration
	// ReadyTimeout is how long a proxy may stay running (it has an
	// address, no probe through it has passed yet) before it is recorded
	// as failed with class timeout and replaced (default 15m). Health does
	// not call a proxy that was never ready unhealthy: a cloud image may
	// take minutes to install and start Squid after the guest reports
	// its address.
	ReadyTimeout time.Duration
	// RetireTimeout is how long a proxy may stay retiring before its delete
	// is re-issued with the next attempt (default 3m).
	RetireTimeout time.Duration
	// StuckDeletes is how many times the delete of a retiring proxy is
	// re-issued before the proxy counts as stuck: its pool's Cleanup
	// condition turns False naming it, and the deletes_stuck gauge counts
	// it (default 3: about 9 minutes with the default RetireTimeout). The
	// delete is still re-issued every RetireTimeout.
	StuckDeletes int
	// QuotaAvoid is how long a target that answered quota, or on which a
	// create got stuck (see MaxCreateAttempts), is not used for placement
	// (default 5m).
	QuotaAvoid time.Duration
	// CheckMaxAge is how old a target's failed check record in
	// fleet-targets may be and still keep new proxies off the target
	// (default 90s: three of health's default check intervals of 30s).
	// An older record, or none, does not: health may be down or may not
	// have polled the target yet, and placement must not stop with it.
	CheckMaxAge time.Duration
	// MaxCreateAttempts is how many times a create is issued for one proxy
	// that never reaches provisioning before the proxy fails with class
	// stuck and is replaced on another target (default 5).
	MaxCreateAttempts int
	// LeaseTTL is the lifetime of the leader lease; it is renewed every
	// third of it (default [bus.LeaseTTL], the fleet-planner bucket's TTL).
	LeaseTTL time.Duration
	// GCInterval is the period of garbage-collection rounds, in which the
	// leader asks every live agent for its inventory (default 1m).
	GCInterval time.Duration
	// GCGrace is how long a marked instance must be seen without a live
	// proxy before it is deleted, and how long a running proxy's instance
	// must be missing from its target's inventory before the proxy fails
	// with class vanished (default 10m).
	GCGrace time.Duration
	// InventoryTimeout bounds one inventory request; a target that does not
	// answer in time is skipped for the round (default 10s).
	InventoryTimeout time.Duration
	// KeepFinished is how many finished (deleted or abandoned) proxies stay
	// in memory, most recent first, so proxy.get answers about them from
	// memory; older ones leave it and proxy.get folds them from the log
	// (default 1000; negative: none).
	KeepFinished int
	// SnapshotEvery is how many sequences of FLEET_EVENTS the projection
	// advances between two snapshots of it (default 50,000; negative: no
	// snapshot by count). See snapshot.go.
	SnapshotEvery int
	// SnapshotInterval is the longest time between two snapshots while
	// events arrive (default 10m; negative: no snapshot by time).
	SnapshotInterval time.Duration
	// AutoscaleInterval is the period of the leader's autoscaling rounds,
	// which size the pools with autoscale by the gateways' demand
	// (default 2s, the gateways' report interval). See autoscale.go.
	AutoscaleInterval time.Duration
	// ExternalAllowCIDRs are ranges the upstream proxies of external
	// pools may be in although the egress policy refuses them (loopback,
	// private, …): an operator's setting (--external-allow-cidrs).
	ExternalAllowCIDRs []netip.Prefix
	// Resolver resolves the hostnames of external proxies at apply, each
	// address checked against the egress policy (default
	// net.DefaultResolver).
	Resolver Resolver
	// ExternalFileInterval is how often the leader reads the files of
	// external pools that name one (default 5s). See external.go.
	ExternalFileInterval time.Duration
}

func (c *Config) defaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.ReconcileInterval, 2*time.Second)
	def(&c.CreateTimeout, 3*time.Minute)
	def(&c.ProvisionTimeout, 15*time.Minute)
	def(&c.ReadyTimeout, 15*time.Minute)
	def(&c.RetireTimeout, 3*time.Minute)
	def(&c.QuotaAvoid, 5*time.Minute)
	def(&c.CheckMaxAge, 90*time.Second)
	def(&c.LeaseTTL, bus.LeaseTTL)
	def(&c.GCInterval, time.Minute)
	def(&c.GCGrace, 10*time.Minute)
	def(&c.InventoryTimeout, 10*time.Second)
	def(&c.AutoscaleInterval, 2*time.Second)
	def(&c.ExternalFileInterval, 5*time.Second)
	if c.Resolver == nil {
		c.Resolver = net.DefaultResolver
	}
	if c.KeepFinished == 0 {
		c.KeepFinished = defaultKeepFinished
	}
	if c.SnapshotEvery == 0 {
		c.SnapshotEvery = 50_000
	}
	if c.SnapshotInterval == 0 {
		c.SnapshotInterval = 10 * time.Minute
	}
	if c.MaxCreateAttempts <= 0 {
		c.MaxCreateAttempts = 5
	}
	if c.StuckDeletes <= 0 {
		c.StuckDeletes = 3
	}
}

// agentSeen is one fleet-agents entry.
type agentSeen struct {
	Entry, Target string
	Images        []string
	Profiles      []string
	Capacity      int
	At            time.Time // server time of the last heartbeat
	// XKey is the agent's curve public key, "" when it announced none (or
	// an invalid one): create commands carrying secrets wait for one.
	XKey string
	// Labels are the target's labels, nil when it announced none (or
	// invalid ones).
	Labels map[string]string
}

// target is what placement reads of the agent's target.
func (a agentSeen) target() decide.Target {
	return decide.Target{Entry: a.Entry, Target: a.Target, Images: a.Images, Profiles: a.Profiles, Capacity: a.Capacity, XKey: a.XKey, Labels: a.Labels}
}

// Planner is one planner replica. Create it with [New] and call [Planner.Run].
type Planner struct {
	conn   *bus.Conn
	store  *bus.EventStore
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer
	m      *metrics
	clocks
	counters
	signals

	// mu guards st, agents, health and progressed.
	mu sync.Mutex
	st *state
	// caughtUp is set once the projection has read the whole log.
	caughtUp atomic.Bool
	// agents is what the agents announced in fleet-agents.
	agents agentBook
	// health is what the health service says: whether a replica is
	// alive (fleet-health) and each target's latest checks
	// (fleet-targets).
	health healthBook
	// demand is the leader's copy of fleet-demand (demand.go).
	demand *demandBook

	// lease is this replica's part in the election of the leader.
	lease leaseState

	// secrets are the pools' secrets: fleet-secrets, the digest key and
	// their sealing to health and the gateway.
	secrets poolSecrets
	// snap writes and loads the state's snapshots (snapshot.go).
	snap *snapshots
	// api serves the operator API over backend{p}.
	api *apiserver.Server
	// extObserver appends the observations of external proxies, as the
	// agent of entry and target external (external.go).
	extObserver *bus.EventStore
	// cooldowns is fleet-gateway-cooldowns, read for the conditions of
	// external pools; nil when it cannot be opened. Set by Run.
	cooldowns jetstream.KeyValue

	fp failpoints // test failpoints; empty in normal builds
}

// clocks are the planner's time sources: time.Now except in tests.
type clocks struct {
	now func() time.Time
	// ageNow is the clock proxy ages are measured with for rotation; tests
	// move it ahead (maxAge is at least a minute).
	ageNow func() time.Time
	// scaleNow is the clock an autoscaled pool's stretch of low demand is
	// measured with; tests move it ahead (scaleDownAfter is at least
	// 10s).
	scaleNow func() time.Time
}

// signals wake the planner's loops.
type signals struct {
	// progressed is closed and replaced whenever st advances (guarded by
	// Planner.mu).
	progressed chan struct{}
	// kick asks the reconciler for a round (see [Planner.poke]).
	kick chan struct{}
}

// counters count the loops' completed work, for tests and logs.
type counters struct {
	rounds      atomic.Int64 // completed reconcile rounds
	looked      atomic.Int64 // pools looked at by reconcile rounds
	gcRounds    atomic.Int64 // completed garbage-collection rounds
	scaleRounds atomic.Int64 // completed autoscaling rounds
}

// agentBook is what the agents announced: the last heartbeat of each
// live one, and every target each entry announced since start. Guarded
// by [Planner.mu].
type agentBook struct {
	// kv is fleet-agents, set by Run before the API starts.
	kv jetstream.KeyValue
	// last maps "<entry>.<target>" to its last heartbeat.
	last map[string]agentSeen
	// seen lists the targets of every entry that heartbeated since start.
	seen map[string]map[string]bool
}

// leaseState is this replica's part in the election of the leader (see
// [Planner.lead] and fence.go).
type leaseState struct {
	// kv is fleet-planner, set by Run: the leader lease and the snapshot
	// writer's claim.
	kv jetstream.KeyValue
	// leading is this replica's current leader term, nil when it does not
	// lead.
	leading atomic.Pointer[leadership]
	// deposed carries a term that [Planner.depose] ended to lead.
	deposed chan *leadership
	// renewed is when the last successful lease create or update was sent.
	renewed atomic.Pointer[time.Time]
}

// poolSecrets are the pools' secrets as the planner keeps them.
type poolSecrets struct {
	// kv is fleet-secrets, set by Run.
	kv jetstream.KeyValue
	// digestKey keys the secrets digests in events; set by Run.
	digestKey []byte
	// creds seals the pools' passwords to health and the gateway
	// (probecreds.go).
	creds *credentials
}

// New returns a planner replica using conn. log, tracer and meter may be
// nil (no logs, traces or metrics).
func New(conn *bus.Conn, cfg Config, log *slog.Logger, tracer trace.Tracer, meter metric.Meter) (*Planner, error) {
	cfg.defaults()
	if cfg.ID == "" {
		return nil, errors.New("planner: Config.ID is required")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if tracer == nil {
		tracer = noop.NewTracerProvider().Tracer("")
	}
	m, err := newMetrics(meter)
	if err != nil {
		return nil, fmt.Errorf("planner metrics: %w", err)
	}
	log = log.With("planner", cfg.ID)
	p := &Planner{
		m:       m,
		conn:    conn,
		store:   bus.NewEventStore(conn, Source, log),
		cfg:     cfg,
		log:     log,
		tracer:  tracer,
		clocks:  clocks{now: time.Now, ageNow: time.Now, scaleNow: time.Now},
		st:      newState(log, cfg.KeepFinished),
		agents:  agentBook{last: map[string]agentSeen{}, seen: map[string]map[string]bool{}},
		health:  healthBook{last: map[string]time.Time{}, checks: map[string]*decide.Check{}},
		demand:  &demandBook{js: conn.JS, log: log},
		signals: signals{progressed: make(chan struct{}), kick: make(chan struct{}, 1)},
		lease:   leaseState{deposed: make(chan *leadership, 1)},
	}
	p.snap = &snapshots{Planner: p, kick: make(chan struct{}, 1)}
	p.extObserver = p.externalObserver()
	if p.api, err = apiserver.New(backend{p}, conn.NC, apiserver.Config{ID: cfg.ID, Log: log, Tracer: tracer, Meter: m.meter, Buckets: durationBuckets}); err != nil {
		return nil, fmt.Errorf("planner API: %w", err)
	}
	p.secrets.creds = &credentials{Planner: p}
	return p, nil
}

// IsLeader reports whether this replica holds the lease and reconciles.
func (p *Planner) IsLeader() bool { return p.lease.leading.Load() != nil }

// Ready reports whether the projection has caught up with the event log and
// the API is being served.
func (p *Planner) Ready() bool { return p.caughtUp.Load() }

// Run replays the event log, then serves the API, follows new events and
// competes for the leader lease until ctx ends. It returns nil on a clean
// shutdown.
func (p *Planner) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	agentsKV, err := p.conn.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketAgents, err)
	}
	p.agents.kv = agentsKV
	healthKV, err := p.conn.JS.KeyValue(ctx, bus.BucketHealth)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketHealth, err)
	}
	targetsKV, err := p.conn.JS.KeyValue(ctx, bus.BucketTargets)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketTargets, err)
	}
	leaseKV, err := p.conn.JS.KeyValue(ctx, bus.BucketPlanner)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketPlanner, err)
	}
	if err := p.openSecrets(ctx); err != nil {
		return err
	}
	p.lease.kv = leaseKV
	p.cooldowns = p.openCooldowns(ctx)
	gauges, err := p.registerGauges()
	if err != nil {
		return fmt.Errorf("planner metrics: %w", err)
	}
	defer func() { _ = gauges.Unregister() }()

	start := time.Now()
	var fromSnap uint64
	if st := p.snap.loadSnapshot(ctx); st != nil {
		p.mu.Lock()
		p.st, p.snap.seq, p.snap.loaded, fromSnap = st, st.seq, st.seq, st.seq
		p.mu.Unlock()
		p.log.Info("state loaded from a snapshot; replaying the events after it", "seq", fromSnap, "took", time.Since(start).String())
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	caught := make(chan struct{})
	var once sync.Once
	wg.Go(func() { p.follow(ctx, func() { once.Do(func() { close(caught) }) }) })
	wg.Go(func() { p.watchKV(ctx, agentsKV, p.onAgent) })
	p.mu.Lock()
	p.health.started = p.now()
	p.mu.Unlock()
	wg.Go(func() { p.watchKV(ctx, healthKV, p.onHealthMember) })
	wg.Go(func() { p.watchKV(ctx, targetsKV, p.onTargetCheck) })

	select {
	case <-caught:
	case <-ctx.Done():
		return nil
	}
	p.caughtUp.Store(true)
	p.mu.Lock()
	seq := p.st.seq
	p.mu.Unlock()
	p.log.Info("state rebuilt from the event log", "seq", seq, "snapshot", fromSnap, "replayed", seq-fromSnap, "took", time.Since(start).String())
	wg.Go(func() { p.snap.snapshotLoop(ctx) })
	for _, r := range p.secrets.creds.readers {
		wg.Go(func() { p.secrets.creds.probeCredsLoop(ctx, r) })
	}

	svc, err := p.api.Start(apiserver.Replica)
	if err != nil {
		cancel()
		return fmt.Errorf("fleet-planner service: %w", err)
	}
	wg.Go(func() { p.lead(ctx, leaseKV) })
	<-ctx.Done()
	if err := svc.Stop(); err != nil {
		p.log.Warn("stop API", "err", err)
	}
	return nil
}

// openSecrets opens fleet-secrets, fleet-probe-creds and
// fleet-gateway-creds and reads (or creates) the digest key.
func (p *Planner) openSecrets(ctx context.Context) error {
	var err error
	if p.secrets.kv, err = p.conn.JS.KeyValue(ctx, bus.BucketSecrets); err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketSecrets, err)
	}
	p.secrets.creds.readers = nil
	for _, r := range []credReader{{name: "health", bucket: bus.BucketProbeCreds}, {name: "the gateway", bucket: bus.BucketGatewayCreds}} {
		if r.kv, err = p.conn.JS.KeyValue(ctx, r.bucket); err != nil {
			return fmt.Errorf("bucket %s: %w", r.bucket, err)
		}
		p.secrets.creds.readers = append(p.secrets.creds.readers, &r)
	}
	if p.secrets.digestKey, err = loadDigestKey(ctx, p.secrets.kv); err != nil {
		return err
	}
	return nil
}

// follow keeps the projection live. It restarts the follow after an error,
// from the next sequence, so a NATS hiccup never loses or repeats events.
func (p *Planner) follow(ctx context.Context, caughtUp func()) {
	for ctx.Err() == nil {
		p.mu.Lock()
		from := p.st.seq + 1
		p.mu.Unlock()
		err := p.store.Follow(ctx, from, p.onEvent, caughtUp)
		if ctx.Err() != nil {
			return
		}
		p.log.Warn("following the event log failed; resuming", "from", from, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (p *Planner) onEvent(ev bus.Event) error {
	p.mu.Lock()
	if ev.Seq <= p.st.seq {
		p.mu.Unlock()
		return nil
	}
	relevant := p.st.apply(ev)
	close(p.progressed)
	p.progressed = make(chan struct{})
	due := p.cfg.SnapshotEvery > 0 && p.st.seq-p.snap.seq >= uint64(p.cfg.SnapshotEvery)
	p.mu.Unlock()
	if due {
		select {
		case p.snap.kick <- struct{}{}:
		default:
		}
	}
	if ev.Aggregate == events.AggregatePlanner && ev.Kind == events.PlannerTerm {
		p.noteTerm(ev.Seq)
	}
	if relevant && p.caughtUp.Load() {
		p.poke()
	}
	if ev.Aggregate == events.AggregateProxy && ev.Kind == events.ProxyFailed && p.caughtUp.Load() && p.IsLeader() {
		p.countDeadLetter(ev)
	}
	return nil
}

// countDeadLetter counts a failure of class dead-letter: a command its
// agent never acknowledged.
func (p *Planner) countDeadLetter(ev bus.Event) {
	var d events.ProxyFailedData
	if ev.DecodeData(&d) != nil || d.Class != events.ClassDeadLetter {
		return
	}
	by := ev.By
	if by.IsZero() {
		p.mu.Lock()
		if x := p.st.proxies[ev.ID]; x != nil {
			by = events.Observer{Entry: x.Entry, Target: x.Target}
		}
		p.mu.Unlock()
	}
	p.m.deadLetters.Add(context.Background(), 1, metric.WithAttributes(
		attribute.String("entry", by.Entry), attribute.String("target", by.Target)))
}

// poke asks for a reconcile round soon.
func (p *Planner) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// waitSeq waits until the projection holds sequence seq, so a reply can read
// what the request wrote.
func (p *Planner) waitSeq(ctx context.Context, seq uint64) error {
	for {
		p.mu.Lock()
		at, ch := p.st.seq, p.progressed
		p.mu.Unlock()
		if at >= seq {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// catchUp waits until the projection holds the last event of one aggregate:
// the re-read after a conflict.
func (p *Planner) catchUp(ctx context.Context, aggregate, id string) error {
	last, err := p.store.Last(ctx, aggregate, id)
	if err != nil || last == nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return p.waitSeq(wctx, last.Seq)
}

// watchKV calls fn with every value and change of bucket kv until ctx
// ends: a watch that fails to start, or ends, is started again a second
// later. The planner keeps its view of the agents (fleet-agents), the
// health replicas (fleet-health) and the targets' checks (fleet-targets)
// this way.
func (p *Planner) watchKV(ctx context.Context, kv jetstream.KeyValue, fn func(jetstream.KeyValueEntry)) {
	for ctx.Err() == nil {
		w, err := kv.WatchAll(ctx)
		if err != nil {
			p.log.Warn("watch "+kv.Bucket(), "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
				continue
			}
		}
		_ = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
			if e != nil {
				fn(e)
			}
		})
		bus.StopWatch(w)
	}
}

func (p *Planner) onAgent(e jetstream.KeyValueEntry) {
	entry, target, ok := splitAgentKey(e.Key())
	if !ok {
		return
	}
	key := e.Key()
	p.mu.Lock()
	defer p.mu.Unlock()
	if e.Operation() != jetstream.KeyValuePut {
		delete(p.agents.last, key)
		return
	}
	var hb agent.Heartbeat
	if err := json.Unmarshal(e.Value(), &hb); err != nil {
		p.log.Warn("ignoring unreadable heartbeat", "key", key, "err", err)
		return
	}
	prev, known := p.agents.last[key]
	if hb.XKey != "" && seal.CheckPublic(hb.XKey) != nil {
		p.log.Warn("ignoring the heartbeat's curve key: it is not a valid xkey", "key", key)
		hb.XKey = ""
	}
	var lv events.ValidationError
	if events.CheckLabels(&lv, "labels", hb.Labels); lv.Err() != nil {
		// Recorded on every proxy placed here, labels must pass the
		// requested event's validation: none rather than bad ones.
		p.log.Warn("ignoring the heartbeat's labels", "key", key, "err", lv.Err())
		hb.Labels = nil
	}
	p.agents.last[key] = agentSeen{Entry: entry, Target: target, Images: hb.Images, Profiles: hb.Profiles, Capacity: hb.Capacity, At: e.Created(), XKey: hb.XKey, Labels: hb.Labels}
	if !known {
		// Each agent's dead-letter series exists from its first
		// heartbeat, at 0, so an alert on its increase has a series to
		// compare with and the dashboards find the metric.
		p.m.deadLetters.Add(context.Background(), 0, metric.WithAttributes(
			attribute.String("entry", entry), attribute.String("target", target)))
	}
	if p.agents.seen[entry] == nil {
		p.agents.seen[entry] = map[string]bool{}
	}
	p.agents.seen[entry][target] = true
	if (!known || prev.XKey != hb.XKey) && p.caughtUp.Load() {
		p.poke()
	}
}

// refreshAgents reads an entry's heartbeats straight from fleet-agents, so
// an agent that announced itself an instant ago is known to the API even
// before the watch delivers its heartbeat.
func (p *Planner) refreshAgents(ctx context.Context, entry string) {
	if p.agents.kv == nil {
		return
	}
	keys, err := p.agents.kv.ListKeysFiltered(ctx, entry+".*")
	if err != nil {
		return
	}
	for k := range keys.Keys() {
		if e, err := p.agents.kv.Get(ctx, k); err == nil {
			p.onAgent(e)
		}
	}
}

// liveAgents returns the agents whose heartbeat has not expired. Callers
// hold p.mu.
func (p *Planner) liveAgentsLocked(now time.Time) []agentSeen {
	out := make([]agentSeen, 0, len(p.agents.last))
	for _, a := range p.agents.last {
		if now.Sub(a.At) < bus.AgentTTL {
			out = append(out, a)
		}
	}
	return out
}

// knownTargetsLocked returns the targets known for entry and whether the
// entry is known at all: from live or seen agents, or named by an event.
// Callers hold p.mu.
func (p *Planner) knownTargetsLocked(entry string) (map[string]bool, bool) {
	out := map[string]bool{}
	known := false
	if m, ok := p.st.targets[entry]; ok {
		known = true
		for t := range m {
			out[t] = true
		}
	}
	if m, ok := p.agents.seen[entry]; ok {
		known = true
		for t := range m {
			out[t] = true
		}
	}
	return out, known
}

// lead competes for the leader lease and, holding it, opens a leader term
// and runs the reconciler of that term. It steps down when the lease cannot
// be renewed or the term is deposed (see fence.go); a deposed replica gives
// the lease back so that the replicas elect a leader with a fresh term. On
// shutdown it releases the lease so another replica takes over at once.
func (p *Planner) lead(ctx context.Context, kv jetstream.KeyValue) {
	// The leader renews every third of the TTL; a follower tries to take
	// the lease every tenth of it, so that it takes over within a tenth of
	// the TTL of the lease's expiry (bucket TTLs leave no marker to watch).
	renewEvery, tryEvery := p.cfg.LeaseTTL/3, p.cfg.LeaseTTL/10
	t := time.NewTimer(renewEvery)
	defer t.Stop()
	var rev uint64
	var cur *leadership
	var done chan struct{}
	stepDown := func() {
		if cur != nil {
			p.lease.leading.CompareAndSwap(cur, nil)
			cur.cancel()
			<-done
			cur, done = nil, nil
		}
	}
	release := func() {
		if rev == 0 {
			return
		}
		dctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		// Only the revision this replica holds is deleted: a lease some
		// other replica acquired meanwhile is left alone.
		if err := kv.Delete(dctx, leaderKey, jetstream.LastRevision(rev)); err != nil {
			p.log.Debug("release leader lease", "err", err)
		} else {
			p.log.Info("leader lease released")
		}
		rev = 0
	}
	for {
		if cur != nil && p.lease.leading.Load() != cur {
			// Deposed (the signal may have been consumed already).
			stepDown()
			release()
		}
		if rev == 0 {
			sent := time.Now()
			if r, err := kv.Create(ctx, leaderKey, []byte(p.cfg.ID)); err == nil {
				rev = r
				p.lease.renewed.Store(&sent)
				if cur, done, err = p.startTerm(ctx, rev); err != nil {
					if ctx.Err() == nil {
						p.log.Warn("leader lease acquired but no planner term could be opened; giving the lease back", "err", err)
					}
					release()
				}
			} else if !errors.Is(err, jetstream.ErrKeyExists) && ctx.Err() == nil {
				p.log.Warn("leader lease", "err", err)
			}
		} else {
			sent := time.Now()
			if r, err := kv.Update(ctx, leaderKey, []byte(p.cfg.ID), rev); err == nil {
				rev = r
				p.lease.renewed.Store(&sent)
			} else if ctx.Err() == nil {
				p.log.Warn("leader lease lost; no longer reconciling", "err", err)
				rev = 0
				stepDown()
			}
		}
		if rev == 0 {
			t.Reset(tryEvery)
		} else {
			t.Reset(renewEvery)
		}
		select {
		case <-t.C:
			continue
		case <-p.lease.deposed:
			// Handled at the top of the loop; a stale signal of an
			// earlier term changes nothing.
			continue
		case <-ctx.Done():
		}
		stepDown()
		if rev != 0 {
			release()
		}
		return
	}
}

// splitAgentKey splits a fleet-agents key "<entry>.<target>".
func splitAgentKey(key string) (entry, target string, ok bool) {
	entry, target, ok = strings.Cut(key, ".")
	return entry, target, ok && events.IsIdentifier(entry) && events.IsIdentifier(target)
}
