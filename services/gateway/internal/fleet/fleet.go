// Package fleet is the gateway's NATS side: it follows the fleet-proxies
// and fleet-pools views into the routing table, opens the pools' proxy
// passwords the planner sealed to the gateway's key in
// fleet-gateway-creds, reports suspect proxies to health and banned ones
// to the planner (through an [api.Client]), shares the per-site cooldowns
// of proxies with the other gateways in fleet-gateway-cooldowns and the
// sticky sessions in fleet-gateway-sessions (sessions.go), writes each
// pool's demand into fleet-demand, loads (or creates) the fleet's gateway
// CA for intercepting pools from fleet-gateway-ca, and serves the
// fleet-gateway micro service (info, stats, ca).
package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/cooldown"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/route"
)

// CheckName reports why name cannot name a gateway, or nil
// ([events.CheckGatewayName]).
func CheckName(name string) error { return events.CheckGatewayName(name) }

// Config configures a [Fleet].
type Config struct {
	// Name is this gateway's name among gateways: its fleet-demand keys
	// are <pool>.<name>, its micro service subjects fleet.gateway.<name>.*.
	Name string
	// Key is the gateway's curve key; the planner seals the pools'
	// passwords to its public half. Gateways share one key.
	Key nkeys.KeyPair
	// DemandInterval is how often demand is written (default 2s).
	DemandInterval time.Duration
	// Listen is the client address, reported by info.
	Listen  string
	Version string
	// Cooldowns is the set of per-site cooldowns the forward server reads
	// (forward.Config.Cooldowns); the Fleet adds the other gateways' to it
	// (nil: a set of its own).
	Cooldowns *cooldown.Set
	// CAOut is a file the gateway CA's certificate (PEM) is written to,
	// mode 0644, once it is loaded ("": none).
	CAOut string
}

// Fleet is the gateway's view of the fleet. Create it with [New], give
// it to forward.New as the server's Fleet, then [Fleet.Run] it.
type Fleet struct {
	cfg   Config
	conn  *bus.Conn
	log   *slog.Logger
	table *route.Table
	srv   *forward.Server

	mu    sync.Mutex
	pools map[string]*poolInfo
	// creds holds each pool's opened password, or why it does not open.
	creds map[string]cred
	// synced is closed once the views' current contents are loaded.
	synced   chan struct{}
	syncOnce sync.Once
	pending  int
	// counted are the buckets whose first load counted toward synced.
	counted map[string]bool

	// planner takes the ban reports; bans queues them for Run.
	planner    *api.Client
	bans       chan banReport
	banBackoff time.Duration

	// cooldowns holds every gateway's per-site cooldowns; cools queues
	// this gateway's for Run to share (cooldowns.go).
	cooldowns     *cooldown.Set
	cools         chan cooldown.Entry
	cooldownRetry time.Duration
	// ca is the gateway CA of intercepting pools (ca.go).
	ca gatewayCA
	// sessions shares the table's sessions with the other gateways
	// (sessions.go).
	sessions *sessions
}

// A ban report is sent at most banAttempts times, the nth retry
// n*banBackoff after the previous attempt, each attempt bounded by
// banRequestTimeout; at most banQueue reports wait to be sent.
const (
	banAttempts       = 5
	banBackoff        = time.Second
	banRequestTimeout = 10 * time.Second
	banQueue          = 256
)

// banReport is a ban to report: a pool's proxy and the rule it matched.
type banReport struct {
	pool    string
	verdict ban.Verdict
}

type poolInfo struct {
	user  string // the pool's auth username, "" for none
	rules []ban.Rule
	// external: the pool's proxies are external, each used with the
	// credentials of its address (cred.external).
	external bool
}

type cred struct {
	password string
	// external holds an external pool's credentials by proxy address.
	external map[string]events.ProxyAuth
	err      error
}

// poolValue is the part of a fleet-pools value the gateway reads.
type poolValue struct {
	Name string          `json:"name"`
	Spec events.PoolSpec `json:"spec"`
}

// New returns a fleet view feeding table.
func New(conn *bus.Conn, table *route.Table, cfg Config, log *slog.Logger) (*Fleet, error) {
	if err := CheckName(cfg.Name); err != nil {
		return nil, err
	}
	if cfg.Key == nil {
		return nil, errors.New("no gateway key")
	}
	if cfg.DemandInterval <= 0 {
		cfg.DemandInterval = 2 * time.Second
	}
	if cfg.Version == "" {
		cfg.Version = buildinfo.Version
	}
	if cfg.Cooldowns == nil {
		cfg.Cooldowns = cooldown.NewSet(events.MaxRetireAfterSitesWindow, nil)
	}
	return &Fleet{cfg: cfg, conn: conn, log: log, table: table,
		pools: map[string]*poolInfo{}, creds: map[string]cred{}, synced: make(chan struct{}), pending: 5, counted: map[string]bool{},
		planner: api.NewClient(conn.NC, api.WithTimeout(banRequestTimeout)), bans: make(chan banReport, banQueue), banBackoff: banBackoff,
		cooldowns: cfg.Cooldowns, cools: make(chan cooldown.Entry, cooldownQueue), cooldownRetry: cooldownRetry,
		sessions: newSessions(table, cfg.Name, log)}, nil
}

// Synced is closed once the gateway loaded the ready proxies, the pools,
// the credentials, the cooldowns and the shared sessions present when it
// started (or found it cannot open the cooldowns or sessions bucket).
func (f *Fleet) Synced() <-chan struct{} { return f.synced }

// markSynced counts the first load of bucket name toward synced.
func (f *Fleet) markSynced(name string) {
	f.mu.Lock()
	if f.counted[name] {
		f.mu.Unlock()
		return
	}
	f.counted[name] = true
	f.pending--
	done := f.pending == 0
	f.mu.Unlock()
	if done {
		f.syncOnce.Do(func() { close(f.synced) })
	}
}

// Known reports whether pool exists (has a fleet-pools key).
func (f *Fleet) Known(pool string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pools[pool] != nil
}

// Credentials returns the basic-auth pair x demands: the user its
// requested event named or its pool's, with the pool's password. A proxy
// of an external pool is used with the credentials of its address, or
// none when the pool lists it without.
func (f *Fleet) Credentials(x route.Proxy) (string, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := f.pools[x.Pool]; p != nil && p.external {
		c := f.creds[x.Pool]
		if a, ok := c.external[x.Address]; ok {
			return a.Username, a.Password, nil
		}
		return "", "", c.err
	}
	user := x.Username
	if p := f.pools[x.Pool]; user == "" && p != nil {
		user = p.user
	}
	if user == "" {
		return "", "", nil
	}
	c, ok := f.creds[x.Pool]
	if !ok {
		return "", "", fmt.Errorf("the proxies demand a password and none is sealed to this gateway's key in %s yet (the planner seals it within seconds of the key's announcement)", bus.BucketGatewayCreds)
	}
	return user, c.password, c.err
}

// Rules returns pool's compiled ban rules.
func (f *Fleet) Rules(pool string) []ban.Rule {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := f.pools[pool]; p != nil {
		return p.rules
	}
	return nil
}

// Suspect tells health that proxy id failed a request.
func (f *Fleet) Suspect(id, reason string) {
	b, _ := json.Marshal(events.Suspect{ID: id, Reason: reason})
	if err := f.conn.NC.Publish(events.SuspectSubject, b); err != nil {
		f.log.Warn("report a suspect proxy", "proxy", id, "err", err)
	}
}

// Banned asks the planner to retire and replace a proxy a ban rule found
// banned; the retiring reason reads "banned: <rule>". It queues the report
// for [Fleet.Run], which sends it; when the queue is full the report is
// dropped and the proxy reported again when its responses match the rule
// again.
func (f *Fleet) Banned(pool string, v ban.Verdict) {
	select {
	case f.bans <- banReport{pool: pool, verdict: v}:
	default:
		f.log.Warn("too many ban reports in flight; this one is dropped and sent again when the proxy's responses match the rule again", "proxy", v.Proxy, "pool", pool, "rule", v.Rule)
		f.rearm(v.Proxy)
	}
}

// reportBans sends each queued ban report in a goroutine of its own until
// ctx ends, then waits for the reports in flight.
func (f *Fleet) reportBans(ctx context.Context) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-f.bans:
			wg.Go(func() { f.reportBan(ctx, r) })
		}
	}
}

// reportBan sends one ban report to the planner, up to banAttempts times
// while the failure is one a retry can mend (the planner failed or did not
// answer), waiting longer before each retry. A report that does not get
// through re-arms the proxy's ban rules.
func (f *Fleet) reportBan(ctx context.Context, r banReport) {
	v := r.verdict
	var err error
	for attempt := range banAttempts {
		if attempt > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(attempt) * f.banBackoff):
			}
		}
		if ctx.Err() != nil {
			err = ctx.Err()
			break
		}
		_, err = f.planner.ReportBan(ctx, api.ProxyBanRequest{ID: v.Proxy, Reason: v.Rule})
		if err == nil {
			f.log.Info("proxy reported banned", "proxy", v.Proxy, "pool", r.pool, "rule", v.Rule)
			return
		}
		if aerr, ok := errors.AsType[*api.APIError](err); ok && !aerr.Retryable() {
			break
		}
	}
	f.log.Warn("report a banned proxy; it is reported again when its responses match the rule again", "proxy", v.Proxy, "pool", r.pool, "rule", v.Rule, "err", err)
	f.rearm(v.Proxy)
}

func (f *Fleet) rearm(id string) {
	if f.srv != nil {
		f.srv.Rearm(id)
	}
}

// Run follows the views, writes demand and serves the micro service
// until ctx ends. srv is the server whose counters it reports.
func (f *Fleet) Run(ctx context.Context, srv *forward.Server) error {
	f.srv = srv
	kv := func(name string) (jetstream.KeyValue, error) {
		b, err := f.conn.JS.KeyValue(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("bucket %s: %w", name, err)
		}
		return b, nil
	}
	proxies, err := kv(bus.BucketProxies)
	if err != nil {
		return err
	}
	pools, err := kv(bus.BucketPools)
	if err != nil {
		return err
	}
	creds, err := kv(bus.BucketGatewayCreds)
	if err != nil {
		return err
	}
	demand, err := kv(bus.BucketDemand)
	if err != nil {
		return err
	}
	if err := f.announceKey(ctx, creds); err != nil {
		return err
	}
	svc, err := f.startService()
	if err != nil {
		return fmt.Errorf("fleet-gateway service: %w", err)
	}
	defer func() { _ = svc.Stop() }()
	if err := f.checkIdentity(); err != nil {
		return err
	}

	var wg sync.WaitGroup
	for name, b := range map[string]bucketWatch{
		bus.BucketPools:        {pools, f.applyPool, f.resetPools},
		bus.BucketProxies:      {proxies, f.applyProxy, f.resetProxies},
		bus.BucketGatewayCreds: {creds, f.applyCred, f.resetCreds},
	} {
		wg.Go(func() { f.watch(ctx, name, b) })
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		f.demandLoop(ctx, demand, creds)
	}()
	wg.Go(func() { f.reportBans(ctx) })
	wg.Go(func() { f.runCooldowns(ctx) })
	wg.Go(func() { f.runCA(ctx) })
	wg.Go(func() { f.sessions.run(ctx, f.conn.JS, func() { f.markSynced(bus.BucketGatewaySessions) }) })
	wg.Wait()
	return nil
}

// bucketWatch is how one bucket's entries reach the gateway: apply applies
// one entry; reset, after each (re)load, drops what the bucket no longer
// holds: what the initial values lacked (seen) and gone confirms.
type bucketWatch struct {
	kv    jetstream.KeyValue
	apply func(jetstream.KeyValueEntry)
	reset func(seen map[string]bool, gone func(key string) bool)
}

// watch follows one bucket, watching again after a failure, and marks it
// synced after its first load.
func (f *Fleet) watch(ctx context.Context, name string, b bucketWatch) {
	delay := 100 * time.Millisecond
	first := true
	for ctx.Err() == nil {
		err := f.load(ctx, b, func() {
			if first {
				first = false
				f.markSynced(name)
			}
		})
		if ctx.Err() != nil {
			return
		}
		f.log.Warn("watch failed; watching again", "bucket", name, "err", err, "in", delay.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// load watches the bucket once, until ctx ends or the watch fails, and
// calls loaded after the reset that follows its initial values. A key the
// initial values lack is dropped only once the bucket reads as not holding
// it: their end can come before a key rewritten meanwhile ([bus.Gone]), and
// dropping a live proxy for that would move the sessions pinned to it.
func (f *Fleet) load(ctx context.Context, b bucketWatch, loaded func()) error {
	gone := func(key string) bool { return bus.Gone(ctx, b.kv, key, f.log) }
	w, err := b.kv.WatchAll(ctx)
	if err != nil {
		return err
	}
	defer bus.StopWatch(w)
	seen := map[string]bool{}
	initial := true
	return bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
		if e == nil {
			if initial {
				initial = false
				b.reset(seen, gone)
				loaded()
			}
			return
		}
		if initial && e.Operation() == jetstream.KeyValuePut {
			seen[e.Key()] = true
		}
		b.apply(e)
	})
}

func deleted(e jetstream.KeyValueEntry) bool {
	return e.Operation() == jetstream.KeyValueDelete || e.Operation() == jetstream.KeyValuePurge
}

func (f *Fleet) applyProxy(e jetstream.KeyValueEntry) {
	id := e.Key()
	var v events.ProxyView
	if deleted(e) || json.Unmarshal(e.Value(), &v) != nil || v.State != events.ProxyReady || v.Address == "" {
		f.removeProxy(id)
		return
	}
	f.table.Set(route.Proxy{ID: v.ID, Pool: v.Pool, Address: v.Address, Username: v.Username, Labels: v.Labels})
}

func (f *Fleet) removeProxy(id string) {
	f.table.Remove(id)
	if f.srv != nil {
		f.srv.Forget(id)
	}
}

func (f *Fleet) resetProxies(seen map[string]bool, gone func(string) bool) {
	for _, id := range f.table.IDs() {
		if !seen[id] && gone(id) {
			f.removeProxy(id)
		}
	}
}

func (f *Fleet) poolNames() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.pools))
	for name := range f.pools {
		out = append(out, name)
	}
	return out
}

func (f *Fleet) applyPool(e jetstream.KeyValueEntry) {
	name := e.Key()
	var v poolValue
	if deleted(e) || json.Unmarshal(e.Value(), &v) != nil {
		f.mu.Lock()
		delete(f.pools, name)
		f.mu.Unlock()
		f.table.SetSpec(name, nil)
		return
	}
	info := &poolInfo{external: v.Spec.Provider == events.ProviderExternal}
	if v.Spec.Auth != nil {
		info.user = v.Spec.Auth.Username
	}
	if g := v.Spec.Gateway; g != nil && len(g.BanRules) > 0 {
		rules, err := ban.Compile(g.BanRules)
		if err != nil {
			f.log.Warn("the pool's ban rules do not compile; the pool is served without them", "pool", name, "err", err)
		}
		info.rules = rules
	}
	f.table.SetSpec(name, v.Spec.Gateway)
	f.mu.Lock()
	f.pools[name] = info
	f.mu.Unlock()
}

func (f *Fleet) resetPools(seen map[string]bool, gone func(string) bool) {
	for _, name := range f.poolNames() {
		if !seen[name] && gone(name) {
			f.mu.Lock()
			delete(f.pools, name)
			f.mu.Unlock()
		}
	}
}

func (f *Fleet) applyCred(e jetstream.KeyValueEntry) {
	pool := e.Key()
	if pool == events.ProbeRecipientKey {
		if !deleted(e) && string(e.Value()) != seal.Public(f.cfg.Key) {
			f.log.Warn("another gateway key was announced (a gateway with another --key-file?): gateways must share one key; announcing this one again at the next demand round")
		}
		return
	}
	if deleted(e) {
		f.mu.Lock()
		delete(f.creds, pool)
		f.mu.Unlock()
		return
	}
	s, err := f.open(pool, e.Value())
	if err != nil {
		f.log.Warn("the pool's proxy password does not open", "pool", pool, "err", err)
	}
	f.mu.Lock()
	f.creds[pool] = cred{password: s.Password, external: s.External, err: err}
	f.mu.Unlock()
}

func (f *Fleet) resetCreds(seen map[string]bool, gone func(string) bool) {
	f.mu.Lock()
	pools := slices.Collect(maps.Keys(f.creds))
	f.mu.Unlock()
	for _, pool := range pools {
		if !seen[pool] && gone(pool) {
			f.mu.Lock()
			delete(f.creds, pool)
			f.mu.Unlock()
		}
	}
}

// open opens one pool's sealed password (and an external pool's
// credentials). Its errors never quote the box or its content.
func (f *Fleet) open(pool string, value []byte) (events.ProbeSecret, error) {
	var none events.ProbeSecret
	var c events.ProbeCredential
	if err := json.Unmarshal(value, &c); err != nil {
		return none, errors.New("the sealed password does not decode")
	}
	plain, err := seal.Open(f.cfg.Key, &c.Sealed)
	if errors.Is(err, seal.ErrWrongKey) {
		return none, fmt.Errorf("%w: it was sealed to another gateway key; give every gateway the same --key-file", err)
	}
	if err != nil {
		return none, err
	}
	var s events.ProbeSecret
	err = json.Unmarshal(plain, &s)
	clear(plain)
	if err != nil {
		return none, errors.New("the sealed password opened but does not decode")
	}
	if s.Pool != pool {
		return none, fmt.Errorf("the password under %q was sealed for pool %q", pool, s.Pool)
	}
	return s, nil
}

// announceKey writes the gateway's public key under _recipient in
// fleet-gateway-creds unless it is there already.
func (f *Fleet) announceKey(ctx context.Context, kv jetstream.KeyValue) error {
	pub := seal.Public(f.cfg.Key)
	e, err := kv.Get(ctx, events.ProbeRecipientKey)
	if err == nil && string(e.Value()) == pub {
		return nil
	}
	if _, err := kv.Put(ctx, events.ProbeRecipientKey, []byte(pub)); err != nil {
		return fmt.Errorf("announce the gateway key in %s: %w", bus.BucketGatewayCreds, err)
	}
	f.log.Info("gateway key announced", "xkey", pub)
	return nil
}

// demandLoop writes each pool's demand every DemandInterval, and keeps
// the gateway's key announced.
func (f *Fleet) demandLoop(ctx context.Context, demand, creds jetstream.KeyValue) {
	t := time.NewTicker(f.cfg.DemandInterval)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			f.writeDemand(ctx, demand, now.Sub(last))
			last = now
			if err := f.announceKey(ctx, creds); err != nil && ctx.Err() == nil {
				f.log.Warn("announce the gateway key", "err", err)
			}
		}
	}
}

// writeDemand writes the demand of every pool that exists, zero for those
// without traffic, so the planner tells "no demand" from "no gateway".
func (f *Fleet) writeDemand(ctx context.Context, kv jetstream.KeyValue, period time.Duration) {
	seen := f.srv.Stats().TakeDemand()
	now := time.Now().UTC()
	for _, pool := range f.poolNames() {
		d := seen[pool]
		v := events.GatewayDemand{Pool: pool, Gateway: f.cfg.Name, Connections: int(d.Peak), At: now}
		if period > 0 {
			v.RequestsPerSecond = float64(d.Requests) / period.Seconds()
		}
		b, _ := json.Marshal(v)
		if _, err := kv.Put(ctx, events.DemandKey(pool, f.cfg.Name), b); err != nil && ctx.Err() == nil {
			f.log.Warn("write demand", "pool", pool, "err", f.refused("$KV."+bus.BucketDemand+"."+events.DemandKey(pool, f.cfg.Name), err))
		}
	}
}
