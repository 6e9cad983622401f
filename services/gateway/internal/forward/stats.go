package forward

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"proxyfleet/services/gateway/internal/route"
)

// Metrics are the gateway's OpenTelemetry instruments.
type Metrics struct {
	requests metric.Int64Counter
	bytes    metric.Int64Counter
	bans     metric.Int64Counter
	duration metric.Float64Histogram
	open     metric.Int64UpDownCounter
}

// NewMetrics creates the instruments on meter.
func NewMetrics(meter metric.Meter) (*Metrics, error) {
	var m Metrics
	var err error
	if m.requests, err = meter.Int64Counter("proxyfleet.gateway.requests",
		metric.WithDescription("Requests and tunnels the gateway carried or failed, by pool, proxy and outcome (ok, aborted, proxy_status, proxy_unreachable, no_proxy, no_credentials, client_gone, body_timeout, gateway_limit); a retried request counts each attempt"),
		metric.WithUnit("{request}")); err != nil {
		return nil, err
	}
	if m.bytes, err = meter.Int64Counter("proxyfleet.gateway.bytes",
		metric.WithDescription("Bytes carried, by pool, proxy and direction (up: client to proxy, down: proxy to client)"),
		metric.WithUnit("By")); err != nil {
		return nil, err
	}
	if m.bans, err = meter.Int64Counter("proxyfleet.gateway.bans",
		metric.WithDescription("Proxies reported banned, by pool and rule"),
		metric.WithUnit("{proxy}")); err != nil {
		return nil, err
	}
	if m.duration, err = meter.Float64Histogram("proxyfleet.gateway.request.duration",
		metric.WithDescription("Time from a request's arrival to the end of its response (of a tunnel: to its close), by pool and outcome"),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)); err != nil {
		return nil, err
	}
	if m.open, err = meter.Int64UpDownCounter("proxyfleet.gateway.connections",
		metric.WithDescription("Requests and tunnels open now, by pool"),
		metric.WithUnit("{connection}")); err != nil {
		return nil, err
	}
	return &m, nil
}

// Counters are the totals of one pool or one proxy.
type Counters struct {
	Requests  int64 `json:"requests"`
	Errors    int64 `json:"errors"`
	Bans      int64 `json:"bans"`
	BytesUp   int64 `json:"bytesUp"`
	BytesDown int64 `json:"bytesDown"`
}

// PoolSnapshot is one pool's counters as [Stats.Snapshot] reports them.
type PoolSnapshot struct {
	Counters
	// Open is the requests and tunnels open now.
	Open    int64               `json:"open"`
	Proxies map[string]Counters `json:"proxies,omitempty"`
}

// Demand is what [Stats.TakeDemand] returns per pool.
type Demand struct {
	// Peak is the most requests and tunnels open at once since the last
	// call (those open now included).
	Peak int64
	// Requests is how many began since the last call.
	Requests int64
}

// Stats counts what the server carried, per pool and per proxy.
type Stats struct {
	m       *Metrics // nil: no metrics
	mu      sync.Mutex
	pools   map[string]*poolStats
	proxies map[string]*proxyStats
}

type counters struct {
	requests, errors, bans, up, down atomic.Int64
}

func (c *counters) snapshot() Counters {
	return Counters{Requests: c.requests.Load(), Errors: c.errors.Load(), Bans: c.bans.Load(), BytesUp: c.up.Load(), BytesDown: c.down.Load()}
}

type poolStats struct {
	name string
	counters
	open     atomic.Int64
	peak     atomic.Int64
	began    atomic.Int64
	metrics  *Metrics
	attrsSet metric.MeasurementOption
}

type proxyStats struct {
	pool string
	counters
}

func newStats(m *Metrics) *Stats {
	return &Stats{m: m, pools: map[string]*poolStats{}, proxies: map[string]*proxyStats{}}
}

func (s *Stats) pool(name string) *poolStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pools[name]
	if p == nil {
		p = &poolStats{name: name, metrics: s.m, attrsSet: metric.WithAttributes(attribute.String("pool", name))}
		s.pools[name] = p
	}
	return p
}

func (s *Stats) proxy(x route.Proxy) *proxyStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.proxies[x.ID]
	if p == nil {
		p = &proxyStats{pool: x.Pool}
		s.proxies[x.ID] = p
	}
	return p
}

func (s *Stats) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.proxies, id)
}

func (p *poolStats) begin() {
	n := p.open.Add(1)
	p.began.Add(1)
	for {
		peak := p.peak.Load()
		if n <= peak || p.peak.CompareAndSwap(peak, n) {
			break
		}
	}
	if p.metrics != nil {
		p.metrics.open.Add(context.Background(), 1, p.attrsSet)
	}
}

func (p *poolStats) end() {
	p.open.Add(-1)
	if p.metrics != nil {
		p.metrics.open.Add(context.Background(), -1, p.attrsSet)
	}
}

func attrs(pool, proxy, outcome string) metric.MeasurementOption {
	return metric.WithAttributes(attribute.String("pool", pool), attribute.String("proxy", proxy), attribute.String("outcome", outcome))
}

// done counts a request or tunnel that proxy x carried.
func (s *Stats) done(x route.Proxy, outcome string, up, down int64, took time.Duration) {
	m := s.m
	ps, xs := s.pool(x.Pool), s.proxy(x)
	for _, c := range []*counters{&ps.counters, &xs.counters} {
		c.requests.Add(1)
		c.up.Add(up)
		c.down.Add(down)
		if outcome != "ok" {
			c.errors.Add(1)
		}
	}
	if m == nil {
		return
	}
	ctx := context.Background()
	m.requests.Add(ctx, 1, attrs(x.Pool, x.ID, outcome))
	m.bytes.Add(ctx, up, metric.WithAttributes(attribute.String("pool", x.Pool), attribute.String("proxy", x.ID), attribute.String("direction", "up")))
	m.bytes.Add(ctx, down, metric.WithAttributes(attribute.String("pool", x.Pool), attribute.String("proxy", x.ID), attribute.String("direction", "down")))
	m.duration.Record(ctx, took.Seconds(), metric.WithAttributes(attribute.String("pool", x.Pool), attribute.String("outcome", outcome)))
}

// failed counts an attempt that carried nothing; proxy is "" when no
// proxy was picked.
func (s *Stats) failed(pool, proxy, kind string, took time.Duration) {
	m := s.m
	ps := s.pool(pool)
	ps.requests.Add(1)
	ps.errors.Add(1)
	if proxy != "" {
		xs := s.proxy(route.Proxy{ID: proxy, Pool: pool})
		xs.requests.Add(1)
		xs.errors.Add(1)
	}
	if m == nil {
		return
	}
	ctx := context.Background()
	m.requests.Add(ctx, 1, attrs(pool, proxy, kind))
	m.duration.Record(ctx, took.Seconds(), metric.WithAttributes(attribute.String("pool", pool), attribute.String("outcome", kind)))
}

// ban counts a proxy a rule found banned.
func (s *Stats) ban(x route.Proxy, rule string) {
	m := s.m
	s.pool(x.Pool).bans.Add(1)
	s.proxy(x).bans.Add(1)
	if m != nil {
		m.bans.Add(context.Background(), 1, metric.WithAttributes(attribute.String("pool", x.Pool), attribute.String("rule", rule)))
	}
}

// Snapshot returns every pool's counters with its proxies'.
func (s *Stats) Snapshot() map[string]PoolSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]PoolSnapshot, len(s.pools))
	for name, p := range s.pools {
		out[name] = PoolSnapshot{Counters: p.snapshot(), Open: p.open.Load(), Proxies: map[string]Counters{}}
	}
	for id, x := range s.proxies {
		if ps, ok := out[x.pool]; ok {
			ps.Proxies[id] = x.snapshot()
		}
	}
	return out
}

// Pools returns the names of the pools the server has seen traffic for.
func (s *Stats) Pools() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.pools))
	for name := range s.pools {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// TakeDemand returns each pool's demand since the last call and starts
// the next period.
func (s *Stats) TakeDemand() map[string]Demand {
	s.mu.Lock()
	pools := make([]*poolStats, 0, len(s.pools))
	for _, p := range s.pools {
		pools = append(pools, p)
	}
	s.mu.Unlock()
	out := make(map[string]Demand, len(pools))
	for _, p := range pools {
		// The next period's peak starts at what is open now.
		peak := p.peak.Swap(p.open.Load())
		out[p.name] = Demand{Peak: max(peak, p.open.Load()), Requests: p.began.Swap(0)}
	}
	return out
}
