package probe

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// credTTL is how long a pool's auth settings are reused before they are
// read again from fleet-pools and fleet-secrets: a changed password is
// picked up within it.
const credTTL = 2 * time.Second

// credCache remembers each pool's basic-auth settings for [credTTL], so
// the probes of a pool's proxies do not each read two buckets.
type credCache struct {
	pools, secrets jetstream.KeyValue
	log            *slog.Logger

	mu     sync.Mutex
	byPool map[string]poolAuth
}

// poolAuth is what one pool's proxies are probed with.
type poolAuth struct {
	user     string // from the pool spec
	password string
	// noPassword says why there is no password, if there is none.
	noPassword error
	at         time.Time
}

func newCredCache(pools, secrets jetstream.KeyValue, log *slog.Logger) *credCache {
	return &credCache{pools: pools, secrets: secrets, log: log, byPool: map[string]poolAuth{}}
}

// credentials returns the basic-auth pair of the proxy's pool, or nil when
// the pool has no auth. The username comes from the requested event (or the
// pool spec), the password from fleet-secrets.
func (c *credCache) credentials(ctx context.Context, v projection.Proxy) *Credentials {
	a := c.auth(ctx, v)
	user := v.Username
	if user == "" {
		user = a.user
	}
	if user == "" {
		return nil
	}
	return &Credentials{Username: user, Password: a.password}
}

func (c *credCache) auth(ctx context.Context, v projection.Proxy) poolAuth {
	now := time.Now()
	c.mu.Lock()
	a, ok := c.byPool[v.Pool]
	c.mu.Unlock()
	if ok && now.Sub(a.at) < credTTL {
		return a
	}
	a = poolAuth{at: now}
	if e, err := c.pools.Get(ctx, v.Pool); err == nil {
		var pool projection.Pool
		if json.Unmarshal(e.Value(), &pool) == nil && pool.Spec.Auth != nil {
			a.user = pool.Spec.Auth.Username
		}
	}
	if e, err := c.secrets.Get(ctx, v.Pool); err != nil {
		a.noPassword = err
	} else {
		var s events.PoolSecrets
		if err := json.Unmarshal(e.Value(), &s); err != nil {
			a.noPassword = errors.New("pool secrets do not decode")
		} else {
			a.password = s.Password
		}
	}
	if a.noPassword != nil && (a.user != "" || v.Username != "") {
		c.log.Warn("no password for the pool's proxies; probing without it", "pool", v.Pool, "err", a.noPassword)
	}
	if ctx.Err() == nil {
		c.mu.Lock()
		c.byPool[v.Pool] = a
		c.mu.Unlock()
	}
	return a
}
