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
	// external holds an external pool's credentials by proxy address.
	external map[string]events.ProxyAuth
	// isExternal: the pool's provider is external; its proxies are probed
	// with their address's credentials (or none), never the password.
	isExternal bool
	// noPassword says why there is no password, if there is none.
	noPassword error
	at         time.Time
}

func newCredCache(pools, creds jetstream.KeyValue, key nkeys.KeyPair, log *slog.Logger) *credCache {
	return &credCache{pools: pools, creds: creds, key: key, log: log, byPool: map[string]poolAuth{}}
}

// credentials returns the basic-auth pair of the proxy's pool, or nil when
// the pool has no auth. The username comes from the requested event (or the
// pool spec), the password from the pool's sealed probe credential. An
// external proxy (one placed on entry [events.ProviderExternal]) is probed
// with the credentials of its address from that credential, or none.
func (c *credCache) credentials(ctx context.Context, v projection.Proxy) *Credentials {
	a := c.auth(ctx, v)
	if a.isExternal || v.Entry == events.ProviderExternal {
		if x, ok := a.external[v.Address]; ok {
			return &Credentials{Username: x.Username, Password: x.Password}
		}
		return nil
	}
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
		a.isExternal = pool.Provider == events.ProviderExternal || pool.Spec.Provider == events.ProviderExternal
	}
	var s events.ProbeSecret
	s, a.noPassword = c.secret(ctx, v.Pool)
	a.password, a.external = s.Password, s.External
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

// secret opens the pool's probe credential. Its errors never quote the
// box or its content.
func (c *credCache) secret(ctx context.Context, pool string) (events.ProbeSecret, error) {
	var none events.ProbeSecret
	e, err := c.creds.Get(ctx, pool)
	if err != nil {
		return none, fmt.Errorf("no probe credential in %s (the planner seals one to this health's key once it sees the key): %w", bus.BucketProbeCreds, err)
	}
	var cred events.ProbeCredential
	if err := json.Unmarshal(e.Value(), &cred); err != nil {
		return none, errors.New("the probe credential does not decode")
	}
	plain, err := seal.Open(c.key, &cred.Sealed)
	if errors.Is(err, seal.ErrWrongKey) {
		return none, fmt.Errorf("%w: health replicas with different keys take turns announcing theirs; give every replica the same --probe-key-file", err)
	}
	if err != nil {
		return none, err
	}
	var s events.ProbeSecret
	err = json.Unmarshal(plain, &s)
	clear(plain)
	if err != nil {
		return none, errors.New("the probe credential opened but does not decode")
	}
	if s.Pool != pool {
		return none, fmt.Errorf("the probe credential under %q was sealed for pool %q", pool, s.Pool)
	}
	return s, nil
}
