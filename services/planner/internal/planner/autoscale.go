package planner

import (
	"context"
	"encoding/json"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// Autoscaling.
//
// Gateways write what they see of each pool's traffic into the
// fleet-demand bucket every few seconds ([events.GatewayDemand] under
// "<pool>.<gateway>"). The leader follows the bucket by watch and, every
// AutoscaleInterval, sizes each pool with autoscale by it: the pool's
// demand is the sum of the connections of its keys written within
// [bus.DemandTTL] (a gateway that stopped no longer counts; no key at
// all is no demand), and it wants ceil(demand / targetConnections)
// proxies, clamped into [min, max]. A pool that wants more than it has
// grows at once; one that wants fewer shrinks only once it wanted fewer
// for the whole scaleDownAfter, and then to the most it wanted within that
// time, so a dip does not shrink it and a pool whose load stopped returns
// to min.
//
// Each change is a pool.scaled event with its reason, appended as every
// reconciler decision is (fenced by the leader's term, expecting the
// pool's last sequence); the fold makes it the pool's size, so the
// reconcile rounds that follow create or retire proxies, and a restarted
// or new leader starts from the size the log holds. A decision is taken
// from the folded state only (the reconciler waits for its own last
// decision to be folded first), so a restart never appends one twice.
// The low-demand window is in memory: a new leader starts it again. While
// the bucket cannot be read (not yet synced, or the identity may not read
// it), nothing is scaled: unknown demand is not zero demand.

// demandRetry is how long the leader waits before it tries to open or
// watch fleet-demand again.
const demandRetry = 5 * time.Second

// demandSeen is the leader's copy of fleet-demand: per pool, the last
// report of each gateway. It is written by the watch and read by the
// autoscaler, under mu.
type demandSeen struct {
	// synced is true once the watch delivered every key the bucket held
	// when it started.
	synced bool
	pools  map[string]map[string]report
}

// report is one gateway's last demand report and when the server stored
// it.
type report struct {
	events.GatewayDemand
	stored time.Time
}

// watchDemand keeps p.demand current from fleet-demand while ctx lasts (the
// leader's term). It opens the bucket itself, and retries, so a bucket the
// planner may not read costs a warning, not the planner.
func (p *Planner) watchDemand(ctx context.Context) {
	defer p.setDemand(func(d *demandSeen) { *d = demandSeen{} })
	warned := false
	for ctx.Err() == nil {
		kv, err := p.conn.JS.KeyValue(ctx, bus.BucketDemand)
		var w jetstream.KeyWatcher
		if err == nil {
			w, err = kv.WatchAll(ctx)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !warned {
				p.log.Warn("cannot read the gateways' demand; pools with autoscale keep their size until it can be read", "bucket", bus.BucketDemand, "err", err)
				warned = true
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(demandRetry):
				continue
			}
		}
		warned = false
		p.readDemand(ctx, w)
		bus.StopWatch(w)
		p.setDemand(func(d *demandSeen) { *d = demandSeen{} })
	}
}

func (p *Planner) readDemand(ctx context.Context, w jetstream.KeyWatcher) {
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil {
				p.setDemand(func(d *demandSeen) { d.synced = true })
				continue
			}
			p.onDemand(e)
		}
	}
}

// onDemand records one fleet-demand entry.
func (p *Planner) onDemand(e jetstream.KeyValueEntry) {
	pool, gateway, ok := strings.Cut(e.Key(), ".")
	if !ok || !events.IsIdentifier(pool) || gateway == "" {
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		p.setDemand(func(d *demandSeen) { delete(d.pools[pool], gateway) })
		return
	}
	var v events.GatewayDemand
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		p.log.Debug("ignoring an unreadable demand report", "key", e.Key(), "err", err)
		return
	}
	p.setDemand(func(d *demandSeen) {
		if d.pools == nil {
			d.pools = map[string]map[string]report{}
		}
		if d.pools[pool] == nil {
			d.pools[pool] = map[string]report{}
		}
		d.pools[pool][gateway] = report{GatewayDemand: v, stored: e.Created()}
	})
}

func (p *Planner) setDemand(fn func(*demandSeen)) {
	p.demandMu.Lock()
	defer p.demandMu.Unlock()
	fn(&p.demand)
}

// demandOf returns the connections pool's fresh reports sum to at now,
// and whether the demand is known at all. A report is fresh while both its
// time and the time the server stored it are within [bus.DemandTTL] of
// now: the bucket's TTL drops stale keys without telling a watch, and a
// gateway whose clock runs ahead does not keep its last report alive.
func (p *Planner) demandOf(pool string, now time.Time) (int, bool) {
	p.demandMu.Lock()
	defer p.demandMu.Unlock()
	if !p.demand.synced {
		return 0, false
	}
	sum := 0
	for _, v := range p.demand.pools[pool] {
		if now.Sub(v.At) < bus.DemandTTL && now.Sub(v.stored) < bus.DemandTTL && v.Connections > 0 {
			sum += v.Connections
		}
	}
	return sum, true
}

// scalable is what the autoscaler needs of one pool, copied under the lock.
type scalable struct {
	name        string
	auto        events.Autoscale
	size        int
	lastSeq     uint64
	traceparent string
}

// autoscale takes one round of scaling decisions: for every live pool with
// autoscale, from its demand now. It runs on the reconciler goroutine.
func (rc *reconciler) autoscale(ctx context.Context) {
	rc.mu.Lock()
	behind := rc.st.seq < rc.ownSeq
	var pools []scalable
	for _, pl := range rc.st.pools {
		if !pl.Deleted && pl.Revision > 0 && pl.Spec.Autoscale != nil {
			pools = append(pools, scalable{name: pl.Name, auto: *pl.Spec.Autoscale, size: pl.Size(), lastSeq: pl.LastSeq, traceparent: pl.traceparent})
		}
	}
	rc.mu.Unlock()
	if behind {
		// Our own last decision is not folded yet: a pool's size may be
		// the one before it.
		return
	}
	now, at := rc.now(), rc.scaleNow()
	seen := make(map[string]bool, len(pools))
	f := rc.flight(ctx)
	for _, pl := range pools {
		seen[pl.name] = true
		conns, known := rc.demandOf(pl.name, now)
		if !known {
			continue
		}
		var low *decide.LowDemand
		if l, ok := rc.lowDemand[pl.name]; ok {
			low = &l
		}
		sc := decide.Scale(pl.auto, pl.size, conns, low, at)
		if sc.Low != nil {
			rc.lowDemand[pl.name] = *sc.Low
		} else {
			delete(rc.lowDemand, pl.name)
		}
		if sc.Size != 0 {
			rc.scale(ctx, f, pl, sc.Size, sc.Reason)
		}
	}
	for name := range rc.lowDemand {
		if !seen[name] {
			delete(rc.lowDemand, name)
		}
	}
	f.wait()
	if ctx.Err() == nil {
		rc.scaleRounds.Add(1)
	}
}

// scale decides that pool pl wants size proxies, for reason.
func (rc *reconciler) scale(ctx context.Context, f *flight, pl scalable, size int, reason string) {
	d := events.PoolScaledData{Size: size, Previous: pl.size, Reason: reason}
	// Later work of the pool's last request.
	ctx, span := rc.startWork(causedBy(ctx, pl.traceparent), "planner.scale", trace.SpanKindInternal,
		attribute.String("pool", pl.name), attribute.Int("size", size), attribute.Int("previous", pl.size))
	f.decide(ctx, span, pl.name, events.AggregatePool, pl.name, &bus.Expect{Seq: pl.lastSeq},
		[]bus.Decision{{Type: events.PoolScaled, MsgID: decisionID(pl.name, events.PoolScaled, pl.lastSeq, d), Data: d}},
		[]any{"pool", pl.name, "decision", events.PoolScaled, "size", size, "previous", pl.size, "reason", reason}, nil)
}
