package planner

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// The planner's metrics, as docs/observability.md ("Planner") lists them.
// The Prometheus exporter drops annotation units ("{proxy}"), appends
// "_total" to counters and "_seconds" to durations in "s": the instrument
// "proxyfleet.planner.replacements" is scraped as
// proxyfleet_planner_replacements_total.
//
// The gauges are read from the folded state when the metrics are
// collected. The fleet's (pools, agents) are reported by the leader
// alone, so that summing over the replicas counts each pool once; every
// replica reports whether it leads.

// durationBuckets fit a reconcile round and an API request: from a
// millisecond to half a minute (the API's request timeout).
var durationBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// metrics are the planner's instruments.
type metrics struct {
	meter metric.Meter

	replacements metric.Int64Counter
	decisions    metric.Int64Counter
	commands     metric.Int64Counter
	deadLetters  metric.Int64Counter
	reconcile    metric.Float64Histogram

	desired      metric.Int64ObservableGauge
	ready        metric.Int64ObservableGauge
	proxies      metric.Int64ObservableGauge
	leader       metric.Int64ObservableGauge
	deletesStuck metric.Int64ObservableGauge
	heartbeatAge metric.Float64ObservableGauge
}

// newMetrics creates the instruments on meter; nil means no metrics.
func newMetrics(meter metric.Meter) (*metrics, error) {
	if meter == nil {
		meter = noop.NewMeterProvider().Meter("")
	}
	m := &metrics{meter: meter}
	var err error
	counter := func(c *metric.Int64Counter, name, unit, desc string) {
		if err == nil {
			*c, err = meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		}
	}
	histogram := func(h *metric.Float64Histogram, name, desc string) {
		if err == nil {
			*h, err = meter.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
				metric.WithExplicitBucketBoundaries(durationBuckets...))
		}
	}
	gauge := func(g *metric.Int64ObservableGauge, name, unit, desc string) {
		if err == nil {
			*g, err = meter.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		}
	}
	counter(&m.replacements, "proxyfleet.planner.replacements", "{replacement}",
		"Replacements requested, by pool and reason class (unhealthy, failed, never-ready, banned, rotated, rolled, recycled, shared-egress, …): a proxy requested to replace another, or a failed proxy retired for the fill to replace")
	counter(&m.decisions, "proxyfleet.planner.decisions", "{decision}",
		"Decision events the planner appended, by type (requested, retiring, abandoned, failed, scaled, condition, applied, deleted)")
	counter(&m.commands, "proxyfleet.planner.commands", "{command}",
		"Backend commands published and acknowledged by the stream, by verb (create, delete)")
	counter(&m.deadLetters, "proxyfleet.planner.dead_letters", "{command}",
		"Commands an agent never acknowledged (proxies failed with class dead-letter), by entry and target")
	histogram(&m.reconcile, "proxyfleet.planner.reconcile.duration", "Duration of one reconcile round")
	gauge(&m.desired, "proxyfleet.pool.desired_proxies", "{proxy}", "Proxies the pool wants: its size, or the size autoscaling set (0 once deleted)")
	gauge(&m.ready, "proxyfleet.pool.ready_proxies", "{proxy}", "Proxies of the pool in state ready")
	gauge(&m.proxies, "proxyfleet.pool.proxies", "{proxy}", "Live proxies of the pool by lifecycle state")
	gauge(&m.leader, "proxyfleet.planner.leader", "", "1 while this replica leads and reconciles, else 0")
	gauge(&m.deletesStuck, "proxyfleet.planner.deletes_stuck", "{proxy}",
		"Retiring proxies of the pool whose delete was re-issued --stuck-deletes times and still did not end in deleted")
	if err == nil {
		m.heartbeatAge, err = meter.Float64ObservableGauge("proxyfleet.agent.heartbeat.age", metric.WithUnit("s"),
			metric.WithDescription("Time since each announced agent's last heartbeat, by entry and target"))
	}
	if err != nil {
		return nil, err
	}
	return m, nil
}

// registerGauges starts reporting the gauges from p's state; the returned
// registration stops it.
func (p *Planner) registerGauges() (metric.Registration, error) {
	m := p.m
	return m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		leads := p.IsLeader()
		var v int64
		if leads {
			v = 1
		}
		o.ObserveInt64(m.leader, v)
		if !leads {
			return nil
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		rules := decide.Config{StuckDeletes: p.cfg.StuckDeletes}
		for _, pl := range p.st.pools {
			if pl.Revision == 0 || pl.Deleted && len(pl.members) == 0 {
				continue
			}
			pool := attribute.String("pool", pl.Name)
			desired := pl.Size()
			if pl.Deleted {
				desired = 0
			}
			o.ObserveInt64(m.desired, int64(desired), metric.WithAttributes(pool))
			o.ObserveInt64(m.ready, int64(pl.counts[events.ProxyReady]), metric.WithAttributes(pool))
			for state, n := range pl.counts {
				if !events.IsTerminal(state) && n > 0 {
					o.ObserveInt64(m.proxies, int64(n), metric.WithAttributes(pool, attribute.String("state", state)))
				}
			}
			stuck := 0
			if pl.counts[events.ProxyRetiring] > 0 {
				for _, x := range pl.members {
					if decide.IsDeleteStuck(rules, x.Proxy) {
						stuck++
					}
				}
			}
			// 0 included, so an alert has a series to compare with.
			o.ObserveInt64(m.deletesStuck, int64(stuck), metric.WithAttributes(pool))
		}
		now := p.now()
		for _, a := range p.agents.last {
			o.ObserveFloat64(m.heartbeatAge, max(now.Sub(a.At).Seconds(), 0),
				metric.WithAttributes(attribute.String("entry", a.Entry), attribute.String("target", a.Target)))
		}
		return nil
	}, m.desired, m.ready, m.proxies, m.leader, m.deletesStuck, m.heartbeatAge)
}

// replaced counts one replacement of a proxy of pool for reason.
func (m *metrics) replaced(ctx context.Context, pool, reason string) {
	m.replacements.Add(ctx, 1, metric.WithAttributes(attribute.String("pool", pool), attribute.String("reason", reasonClass(reason))))
}

// decided counts appended decision events of type typ.
func (m *metrics) decided(ctx context.Context, typ string, n int) {
	m.decisions.Add(ctx, int64(n), metric.WithAttributes(attribute.String("type", typ)))
}

// reasonClasses are the reason classes of replacements; any other reason
// counts as "other", so the label's values stay few.
var reasonClasses = map[string]bool{
	"unhealthy": true, "failed": true, "never-ready": true, "banned": true, "rotated": true,
	"rolled": true, "recycled": true, "replaced": true, "deleted": true, "shared-egress": true,
}

// reasonClass is the class of a retiring or replacement reason: its first
// word ("unhealthy: probe failed" → "unhealthy", "recycled by operator" →
// "recycled").
func reasonClass(reason string) string {
	s := strings.TrimSpace(reason)
	if i := strings.IndexAny(s, ": "); i >= 0 {
		s = s[:i]
	}
	if reasonClasses[s] {
		return s
	}
	return "other"
}
