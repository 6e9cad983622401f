package planner

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// The gateways' demand, as the leader reads it for autoscaling (see
// autoscale.go).

// demandRetry is how long the leader waits before it tries to open or
// watch fleet-demand again.
const demandRetry = 5 * time.Second

// demandBook is the leader's copy of fleet-demand: per pool, the last
// report of each gateway. It is written by the watch and read by the
// autoscaler.
type demandBook struct {
	js  jetstream.JetStream
	log *slog.Logger

	mu   sync.Mutex
	seen demandSeen
}

// demandSeen is what a [demandBook] holds, under its mu.
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

// watch keeps d current from fleet-demand while ctx lasts (the leader's
// term). It opens the bucket itself, and retries, so a bucket the
// planner may not read costs a warning, not the planner.
func (d *demandBook) watch(ctx context.Context) {
	defer d.set(func(s *demandSeen) { *s = demandSeen{} })
	warned := false
	for ctx.Err() == nil {
		kv, err := d.js.KeyValue(ctx, bus.BucketDemand)
		var w jetstream.KeyWatcher
		if err == nil {
			w, err = kv.WatchAll(ctx)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !warned {
				d.log.Warn("cannot read the gateways' demand; pools with autoscale keep their size until it can be read", "bucket", bus.BucketDemand, "err", err)
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
		_ = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
			if e == nil {
				d.set(func(s *demandSeen) { s.synced = true })
				return
			}
			d.on(e)
		})
		bus.StopWatch(w)
		d.set(func(s *demandSeen) { *s = demandSeen{} })
	}
}

// on records one fleet-demand entry.
func (d *demandBook) on(e jetstream.KeyValueEntry) {
	pool, gateway, ok := strings.Cut(e.Key(), ".")
	if !ok || !events.IsIdentifier(pool) || gateway == "" {
		return
	}
	if e.Operation() != jetstream.KeyValuePut {
		d.set(func(s *demandSeen) { delete(s.pools[pool], gateway) })
		return
	}
	var v events.GatewayDemand
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		d.log.Debug("ignoring an unreadable demand report", "key", e.Key(), "err", err)
		return
	}
	d.set(func(s *demandSeen) {
		if s.pools == nil {
			s.pools = map[string]map[string]report{}
		}
		if s.pools[pool] == nil {
			s.pools[pool] = map[string]report{}
		}
		s.pools[pool][gateway] = report{GatewayDemand: v, stored: e.Created()}
	})
}

func (d *demandBook) set(fn func(*demandSeen)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	fn(&d.seen)
}

// of returns the connections pool's fresh reports sum to at now,
// and whether the demand is known at all. A report is fresh while both its
// time and the time the server stored it are within [bus.DemandTTL] of
// now: the bucket's TTL drops stale keys without telling a watch, and a
// gateway whose clock runs ahead does not keep its last report alive.
func (d *demandBook) of(pool string, now time.Time) (int, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.seen.synced {
		return 0, false
	}
	sum := 0
	for _, v := range d.seen.pools[pool] {
		if now.Sub(v.At) < bus.DemandTTL && now.Sub(v.stored) < bus.DemandTTL && v.Connections > 0 {
			sum += v.Connections
		}
	}
	return sum, true
}
