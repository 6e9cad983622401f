package fleet

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/gateway/internal/cooldown"
	"proxyfleet/services/gateway/internal/forward"
)

// The per-site cooldowns are shared by every gateway through the
// fleet-gateway-cooldowns bucket: each gateway writes the cooldowns its
// ban rules decide (events.GatewayCooldown under events.CooldownKey) and
// watches the bucket into its cooldown.Set, so no gateway sends a site
// through a proxy another gateway saw banned there, and a restarted
// gateway loads them before it serves (Synced waits for them). An entry
// ends at its until, whether or not the bucket dropped it yet; deleting
// its key ends it at once.
//
// The bucket is not needed to route: without it (not created yet, or the
// gateway's NATS identity may not use it) the gateway serves with the
// cooldowns it decides itself and tries the bucket again every
// cooldownRetry.

// cooldownQueue bounds the cooldowns waiting to be written.
const cooldownQueue = 256

// cooldownRetry is how long the gateway waits before it tries again to
// open the bucket.
const cooldownRetry = 30 * time.Second

var _ forward.CooldownSharer = (*Fleet)(nil)

// ShareCooldown queues e for the fleet-gateway-cooldowns bucket. When the
// queue is full, e stays this gateway's own.
func (f *Fleet) ShareCooldown(e cooldown.Entry) {
	select {
	case f.cools <- e:
	default:
		f.log.Warn("too many cooldowns waiting to be written; this one is kept by this gateway only", "proxy", e.Proxy, "pool", e.Pool, "site", e.Site)
	}
}

// runCooldowns shares the cooldowns through the bucket until ctx ends.
func (f *Fleet) runCooldowns(ctx context.Context) {
	var kv jetstream.KeyValue
	for {
		var err error
		if kv, err = f.conn.JS.KeyValue(ctx, bus.BucketGatewayCooldowns); err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		f.log.Error("cannot open the cooldowns bucket: this gateway keeps the per-site cooldowns it decides to itself and learns none of the other gateways'; create it (the topology declares it) and let the gateway's identity watch it and publish to $KV."+bus.BucketGatewayCooldowns+".*.*",
			"bucket", bus.BucketGatewayCooldowns, "err", err, "retry_in", f.cooldownRetry.String())
		// The gateway does not wait for it to serve.
		f.markSynced(bus.BucketGatewayCooldowns)
		select {
		case <-ctx.Done():
			return
		case <-time.After(f.cooldownRetry):
		}
	}
	var wg sync.WaitGroup
	wg.Go(func() { f.writeCooldowns(ctx, kv) })
	f.watch(ctx, bus.BucketGatewayCooldowns, bucketWatch{kv, f.applyCooldown, f.resetCooldowns})
	wg.Wait()
}

// writeCooldowns writes each queued cooldown until ctx ends.
func (f *Fleet) writeCooldowns(ctx context.Context, kv jetstream.KeyValue) {
	for {
		select {
		case <-ctx.Done():
			return
		case e := <-f.cools:
			b, _ := json.Marshal(events.GatewayCooldown{Proxy: e.Proxy, Pool: e.Pool, Site: e.Site, Rule: e.Rule,
				Gateway: f.cfg.Name, At: e.At.UTC(), Until: e.Until.UTC()})
			if _, err := kv.Put(ctx, events.CooldownKey(e.Proxy, e.Site), b); err != nil && ctx.Err() == nil {
				f.log.Warn("share a cooldown; the other gateways do not learn it", "bucket", bus.BucketGatewayCooldowns, "proxy", e.Proxy, "site", e.Site, "err", err)
			}
		}
	}
}

// applyCooldown adds a cooldown of the bucket (another gateway's, or this
// one's back from it) to the set, or drops one whose key was deleted.
func (f *Fleet) applyCooldown(e jetstream.KeyValueEntry) {
	if deleted(e) {
		proxy, enc, _ := strings.Cut(e.Key(), ".")
		if site, err := base64.RawURLEncoding.DecodeString(enc); err == nil {
			f.cooldowns.Remove(proxy, string(site))
		}
		return
	}
	var v events.GatewayCooldown
	if err := json.Unmarshal(e.Value(), &v); err != nil || v.Proxy == "" || v.Site == "" || events.CooldownKey(v.Proxy, v.Site) != e.Key() {
		f.log.Warn("a cooldown entry does not decode, or does not match its key; ignored", "bucket", bus.BucketGatewayCooldowns, "key", e.Key())
		return
	}
	// No cooldown lasts longer than a rule may ask for, whoever wrote it.
	until := v.Until
	if limit := v.At.Add(events.MaxBanCooldown); until.After(limit) {
		until = limit
	}
	f.cooldowns.Add(cooldown.Entry{Proxy: v.Proxy, Pool: v.Pool, Site: v.Site, Rule: v.Rule, At: v.At, Until: until})
}

// resetCooldowns keeps what a reload did not see: a cooldown ends at its
// until, and one this gateway decided may still be on its way to the
// bucket.
func (f *Fleet) resetCooldowns(map[string]bool, func(string) bool) {}
