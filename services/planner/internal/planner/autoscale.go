package planner

import (
	"context"

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
		conns, known := rc.demand.of(pl.name, now)
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
