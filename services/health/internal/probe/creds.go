package probe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/health/internal/projection"
)

// credTTL is how long a pool's auth settings are reused before they are
// read again from fleet-pools and fleet-probe-creds: a changed password is
// picked up within it (after the planner sealed it).
const credTTL = 2 * time.Second

// credCache remembers each pool's basic-auth settings for [credTTL], so
// the probes of a pool's proxies do not each read two buckets. The
// password comes from fleet-probe-creds, sealed by the planner to key:
// health never reads fleet-secrets.
type credCache struct {
	pools, creds jetstream.KeyValue
	key          nkeys.KeyPair
	log          *slog.Logger

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

func newCredCache(pools, creds jetstream.KeyValue, key nkeys.KeyPair, log *slog.Logger) *credCache {
	return &credCache{pools: pools, creds: creds, key: key, log: log, byPool: map[string]poolAuth{}}
}

// credentials returns the basic-auth pair of the proxy's pool, or nil when
// the pool has no auth. The username comes from the requested event (or the
// pool spec), the password from the pool's sealed probe credential.
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
	a.password, a.noPassword = c.password(ctx, v.Pool)
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

// password opens the pool's probe credential. Its errors never quote the
// box or its content.
func (c *credCache) password(ctx context.Context, pool string) (string, error) {
	e, err := c.creds.Get(ctx, pool)
	if err != nil {
		return "", fmt.Errorf("no probe credential in %s (the planner seals one to this health's key once it sees the key): %w", bus.BucketProbeCreds, err)
	}
	var cred events.ProbeCredential
	if err := json.Unmarshal(e.Value(), &cred); err != nil {
		return "", errors.New("the probe credential does not decode")
	}
	plain, err := seal.Open(c.key, &cred.Sealed)
	if errors.Is(err, seal.ErrWrongKey) {
		return "", fmt.Errorf("%w: health replicas with different keys take turns announcing theirs; give every replica the same --probe-key-file", err)
	}
	if err != nil {
		return "", err
	}
	var s events.ProbeSecret
	if err := json.Unmarshal(plain, &s); err != nil {
		return "", errors.New("the probe credential opened but does not decode")
	}
	if s.Pool != pool {
		return "", fmt.Errorf("the probe credential under %q was sealed for pool %q", pool, s.Pool)
	}
	return s.Password, nil
}
