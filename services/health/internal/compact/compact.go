// Package compact removes old delete markers from the buckets health
// writes (fleet-proxies, fleet-pools, fleet-probes, fleet-targets).
//
// A key deleted from a JetStream key-value bucket leaves a marker, so that
// a watcher learns of the deletion; the bucket keeps it for ever. Every
// proxy the fleet replaces leaves one in fleet-proxies and one in
// fleet-probes: a year of churn leaves millions, each held in the server's
// memory and read by every watcher that starts (the gateways, the console,
// health's probers). A [Compactor] purges the markers older than a horizon
// (24 h by default): a watcher that was following the bucket saw them long
// ago, and one that starts later needs only the keys that exist.
//
// The purge of a marker is bounded by its sequence, so a value written to
// the same key after it (a pool applied again under its name) is never
// removed. Purging is idempotent, so every health replica runs a
// compactor, each at its own jittered times.
package compact

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
)

// Buckets are the buckets health writes, whose deletions it compacts.
var Buckets = []string{bus.BucketProxies, bus.BucketPools, bus.BucketProbes, bus.BucketTargets}

// Config tunes a [Compactor]. Zero values take the defaults noted.
type Config struct {
	// Every is the time between two rounds (default 1 h); the first
	// round starts at a random time within the first Every.
	Every time.Duration
	// After is the age of the markers a round removes (default 24 h): a
	// watcher disconnected for longer than this while its process kept
	// running could miss a deletion, so keep it well above any outage.
	After time.Duration
	// Buckets to compact (default [Buckets]).
	Buckets []string
}

func (c *Config) defaults() {
	if c.Every <= 0 {
		c.Every = time.Hour
	}
	if c.After <= 0 {
		c.After = 24 * time.Hour
	}
	if len(c.Buckets) == 0 {
		c.Buckets = Buckets
	}
}

// Compactor removes old delete markers. Create it with [New].
type Compactor struct {
	conn *bus.Conn
	cfg  Config
	log  *slog.Logger
}

// New returns a compactor using c.
func New(c *bus.Conn, cfg Config, log *slog.Logger) *Compactor {
	cfg.defaults()
	return &Compactor{conn: c, cfg: cfg, log: log}
}

// Result is what one round did to one bucket.
type Result struct {
	Bucket  string
	Removed int // markers older than the horizon, purged
	Kept    int // younger markers, left for the next rounds
}

// Run compacts every Every until ctx ends. A failed round is logged and
// tried again at the next.
func (c *Compactor) Run(ctx context.Context) error {
	wait := time.Duration(rand.Int64N(int64(c.cfg.Every)))
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = c.cfg.Every
		for _, b := range c.cfg.Buckets {
			r, err := c.Bucket(ctx, b, time.Now())
			switch {
			case ctx.Err() != nil:
				return nil
			case err != nil:
				c.log.Warn("compacting a bucket's delete markers failed; trying again at the next round",
					"bucket", b, "err", err, "next", c.cfg.Every.String())
			case r.Removed > 0:
				c.log.Info("removed old delete markers", "bucket", b, "removed", r.Removed, "kept", r.Kept, "older_than", c.cfg.After.String())
			default:
				c.log.Debug("no old delete markers", "bucket", b, "kept", r.Kept)
			}
		}
	}
}

// Bucket removes bucket's delete markers created before now minus the
// horizon. Each purge covers the marker's key up to the marker's own
// sequence, so a later value of that key stays.
func (c *Compactor) Bucket(ctx context.Context, bucket string, now time.Time) (Result, error) {
	res := Result{Bucket: bucket}
	kv, err := c.conn.JS.KeyValue(ctx, bucket)
	if err != nil {
		return res, fmt.Errorf("bucket %s: %w", bucket, err)
	}
	stream, err := c.conn.JS.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return res, fmt.Errorf("bucket %s: %w", bucket, err)
	}
	old, kept, err := markers(ctx, kv, now.Add(-c.cfg.After))
	if err != nil {
		return res, fmt.Errorf("bucket %s: reading its keys: %w", bucket, err)
	}
	res.Kept = kept
	res.Removed, err = purge(ctx, stream, bucket, old)
	if err != nil {
		return res, fmt.Errorf("bucket %s: %w", bucket, err)
	}
	return res, nil
}

// purge removes the markers old of bucket, each with what its key held
// before it, up to the marker's own sequence; it returns how many it
// removed.
func purge(ctx context.Context, stream jetstream.Stream, bucket string, old []jetstream.KeyValueEntry) (int, error) {
	for i, m := range old {
		err := stream.Purge(ctx, jetstream.WithPurgeSubject("$KV."+bucket+"."+m.Key()), jetstream.WithPurgeSequence(m.Revision()+1))
		if err != nil {
			return i, fmt.Errorf("purging the marker of %s: %w", m.Key(), err)
		}
	}
	return len(old), nil
}

// markers reads the last entry of every key of kv and returns the delete
// markers created before limit, and how many younger ones there are.
func markers(ctx context.Context, kv jetstream.KeyValue, limit time.Time) (old []jetstream.KeyValueEntry, kept int, err error) {
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return nil, 0, err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		case e, ok := <-w.Updates():
			if !ok {
				return nil, 0, errors.New("the watch ended before the keys were read")
			}
			if e == nil { // every key read
				return old, kept, nil
			}
			if op := e.Operation(); op != jetstream.KeyValueDelete && op != jetstream.KeyValuePurge {
				continue
			}
			if e.Created().Before(limit) {
				old = append(old, e)
			} else {
				kept++
			}
		}
	}
}
