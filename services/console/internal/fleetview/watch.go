package fleetview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Follower keeps a [Store] in step with the buckets. Create it with
// [NewFollower] and call [Follower.Run].
type Follower struct {
	js    jetstream.JetStream
	store *Store
	log   *slog.Logger
	// SampleEvery is the time between two points of the pools' history.
	sampleEvery time.Duration
}

// NewFollower returns a follower of the buckets on js into store, sampling
// the pools' history every sampleEvery (10s when 0).
func NewFollower(js jetstream.JetStream, store *Store, sampleEvery time.Duration, log *slog.Logger) *Follower {
	if sampleEvery <= 0 {
		sampleEvery = 10 * time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Follower{js: js, store: store, log: log, sampleEvery: sampleEvery}
}

// bucketApply turns one bucket's entry into a store update: value nil
// for a deleted key.
type bucketApply func(s *Store, key string, value []byte) error

var buckets = map[string]bucketApply{
	bus.BucketPools: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutPool(key, nil)
			return nil
		}
		var raw struct {
			Pool
			SecretsDigest string `json:"secretsDigest"`
		}
		if err := json.Unmarshal(value, &raw); err != nil {
			return err
		}
		raw.Pool.HasSecrets = raw.SecretsDigest != ""
		s.PutPool(key, &raw.Pool)
		return nil
	},
	bus.BucketProxies: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutProxy(key, nil)
			return nil
		}
		var v events.ProxyView
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		if v.ID == "" {
			v.ID = key
		}
		s.PutProxy(key, &v)
		return nil
	},
	bus.BucketProbes: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutProbe(key, nil)
			return nil
		}
		var v Probe
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		s.PutProbe(key, &v)
		return nil
	},
	bus.BucketAgents: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutAgent(key, nil)
			return nil
		}
		var v Agent
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		s.PutAgent(key, &v)
		return nil
	},
	bus.BucketTargets: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutCheck(key, nil)
			return nil
		}
		var v TargetCheck
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		s.PutCheck(key, &v)
		return nil
	},
	bus.BucketGatewayCooldowns: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutCooldown(key, nil)
			return nil
		}
		var v Cooldown
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		s.PutCooldown(key, &v)
		return nil
	},
	bus.BucketDemand: func(s *Store, key string, value []byte) error {
		if value == nil {
			s.PutDemand(key, nil)
			return nil
		}
		var v Demand
		if err := json.Unmarshal(value, &v); err != nil {
			return err
		}
		s.PutDemand(key, &v)
		return nil
	},
}

// Buckets are the buckets a [Follower] reads: the console's NATS identity
// needs read access to each (deploy/nats CONSOLE_PERMS).
func Buckets() []string {
	return []string{bus.BucketPools, bus.BucketProxies, bus.BucketProbes, bus.BucketAgents, bus.BucketTargets, bus.BucketDemand, bus.BucketGatewayCooldowns, bus.BucketHealth}
}

// Run follows every bucket until ctx ends, and samples the history.
func (f *Follower) Run(ctx context.Context) error {
	done := make(chan struct{})
	n := 0
	for name, apply := range buckets {
		n++
		go func() { f.follow(ctx, name, apply); done <- struct{}{} }()
	}
	n++
	go func() {
		f.follow(ctx, bus.BucketHealth, func(s *Store, key string, value []byte) error {
			// A replica's key is renewed every beat: only when matters.
			if value == nil {
				s.PutHealth(key, time.Time{})
			} else {
				s.PutHealth(key, time.Now())
			}
			return nil
		})
		done <- struct{}{}
	}()
	t := time.NewTicker(f.sampleEvery)
	defer t.Stop()
	f.store.Sample(time.Now())
	for {
		select {
		case <-ctx.Done():
			for range n {
				<-done
			}
			return nil
		case now := <-t.C:
			f.store.Sample(now)
		}
	}
}

// follow watches one bucket, again after a pause whenever the watch
// fails or ends, until ctx ends. After each (re)start the keys the
// bucket no longer holds are dropped once its initial values are in.
func (f *Follower) follow(ctx context.Context, bucket string, apply bucketApply) {
	pause := time.Second
	for ctx.Err() == nil {
		err := f.watch(ctx, bucket, apply, func() {})
		if ctx.Err() != nil {
			return
		}
		f.log.Warn("the watch of a bucket stopped; watching it again", "bucket", bucket, "err", err, "retry_in", pause.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, 30*time.Second)
	}
}

// watch watches one bucket once, until ctx ends or the watch fails, and
// calls loaded once its initial values are in and what it no longer holds
// is dropped. A key of the store the initial values lack is dropped only
// once the bucket reads as not holding it: their end can come before a key
// rewritten meanwhile ([bus.Gone]).
func (f *Follower) watch(ctx context.Context, bucket string, apply bucketApply, loaded func()) error {
	kv, err := f.js.KeyValue(ctx, bucket)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bucket, err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return fmt.Errorf("watch %s: %w", bucket, err)
	}
	defer bus.StopWatch(w)
	seen := map[string]bool{}
	initial := true
	have := f.store.keys(bucket)
	err = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
		if e == nil {
			if initial {
				for k := range have {
					if !seen[k] && bus.Gone(ctx, kv, k, f.log) {
						_ = apply(f.store, k, nil)
					}
				}
				initial, seen = false, nil
				f.store.markSynced(bucket)
				loaded()
			}
			return
		}
		key := e.Key()
		if initial {
			seen[key] = true
		}
		var value []byte
		if e.Operation() == jetstream.KeyValuePut {
			value = e.Value()
		}
		if err := apply(f.store, key, value); err != nil {
			f.log.Warn("a value of a bucket does not decode; it is left out", "bucket", bucket, "key", key, "err", err)
		}
	})
	if err == nil {
		return nil
	}
	if errors.Is(err, bus.ErrWatchEnded) {
		return err
	}
	return fmt.Errorf("watch %s: %w", bucket, err)
}

// keys returns the keys the store holds from bucket, so that a watch that
// starts again drops those the bucket lost meanwhile.
func (s *Store) keys(bucket string) map[string]bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string]bool{}
	switch bucket {
	case bus.BucketPools:
		for n, p := range s.pools {
			if p.pool != nil {
				out[n] = true
			}
		}
	case bus.BucketProxies:
		for k := range s.proxies {
			out[k] = true
		}
	case bus.BucketProbes:
		for k := range s.probes {
			out[k] = true
		}
	case bus.BucketAgents:
		for k := range s.agents {
			out[k] = true
		}
	case bus.BucketTargets:
		for k := range s.checks {
			out[k] = true
		}
	case bus.BucketDemand:
		for k := range s.demand {
			out[k] = true
		}
	case bus.BucketHealth:
		for k := range s.health {
			out[k] = true
		}
	case bus.BucketGatewayCooldowns:
		for _, m := range s.cooldowns {
			for k := range m {
				out[k] = true
			}
		}
	}
	return out
}
