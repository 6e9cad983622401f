package planner

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

// probeCredsSweep is how often every pool's sealed credential is checked
// against fleet-secrets and its reader's key, whatever changed: it repairs
// a write that raced a key change or an apply.
const probeCredsSweep = 30 * time.Second

// credentials keeps the pools' passwords sealed to each service that
// uses them (health, the gateway) in that service's bucket. It embeds the
// planner whose state and fleet-secrets it reads.
type credentials struct {
	*Planner
	// readers are health (fleet-probe-creds) and the gateway
	// (fleet-gateway-creds), set by Run.
	readers []*credReader
}

// credReader is a service that uses the pools' proxy passwords without
// reading fleet-secrets: it announces a curve key under
// events.ProbeRecipientKey in its bucket, and the planner seals each
// pool's password to that key under the pool's name there
// (events.ProbeCredential). Health probes with them (fleet-probe-creds);
// the gateway adds them to the requests it relays (fleet-gateway-creds).
type credReader struct {
	name   string // "health", "the gateway": for logs
	bucket string
	kv     jetstream.KeyValue
}

// probeCredsLoop keeps r's bucket current, so r uses each pool's
// password without reading fleet-secrets: at start, whenever r announces
// a new key, and every probeCredsSweep.
func (c *credentials) probeCredsLoop(ctx context.Context, r *credReader) {
	t := time.NewTicker(probeCredsSweep)
	defer t.Stop()
	var w jetstream.KeyWatcher
	defer func() { bus.StopWatch(w) }()
	for {
		if w == nil {
			var err error
			if w, err = r.kv.Watch(ctx, events.ProbeRecipientKey, jetstream.UpdatesOnly()); err != nil {
				c.log.Warn("watch the announced key", "reader", r.name, "bucket", r.bucket, "err", err)
				w = nil
			}
		}
		c.syncProbeCreds(ctx, r)
		var updates <-chan jetstream.KeyValueEntry
		if w != nil {
			updates = w.Updates()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case _, ok := <-updates:
			if !ok {
				bus.StopWatch(w)
				w = nil
			}
		}
	}
}

// probeRecipient returns the curve key r announced, "" when none.
func (c *credentials) probeRecipient(ctx context.Context, r *credReader) (string, error) {
	e, err := r.kv.Get(ctx, events.ProbeRecipientKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	to := string(e.Value())
	if err := seal.CheckPublic(to); err != nil {
		c.log.Warn("the announced key is not a curve key; passwords are not sealed to it until it is", "reader", r.name, "bucket", r.bucket, "key", events.ProbeRecipientKey)
		return "", nil
	}
	return to, nil
}

// syncProbeCreds brings every pool's credential in r's bucket up to
// date, and removes those of deleted pools.
func (c *credentials) syncProbeCreds(ctx context.Context, r *credReader) {
	to, err := c.probeRecipient(ctx, r)
	if err != nil {
		c.log.Warn("read the announced key", "reader", r.name, "bucket", r.bucket, "err", err)
		return
	}
	type poolRev struct {
		name    string
		deleted bool
		rev     int
	}
	c.mu.Lock()
	pools := make([]poolRev, 0, len(c.st.pools))
	for name, pl := range c.st.pools {
		pools = append(pools, poolRev{name: name, deleted: pl.Deleted, rev: pl.Revision})
	}
	c.mu.Unlock()
	for _, pl := range pools {
		if ctx.Err() != nil {
			return
		}
		if pl.deleted {
			c.removeProbeCred(ctx, r, pl.name, pl.rev)
			continue
		}
		if to != "" {
			c.syncProbeCred(ctx, r, pl.name, to)
		}
	}
}

// probeCredNow brings an applied pool's credentials up to date at once,
// so health and the gateway use a new password without waiting for the
// sweep. A failure only delays it to the sweep.
func (c *credentials) probeCredNow(ctx context.Context, pool string) {
	for _, r := range c.readers {
		to, err := c.probeRecipient(ctx, r)
		if err != nil || to == "" {
			continue
		}
		c.syncProbeCred(ctx, r, pool, to)
	}
}

// syncProbeCred seals the pool's password from fleet-secrets to r's key
// to, unless the stored credential already is that. A pool without a
// password has no credential.
func (c *credentials) syncProbeCred(ctx context.Context, r *credReader, pool, to string) {
	e, err := c.secrets.kv.Get(ctx, pool)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return
	}
	if err != nil {
		c.log.Warn("read pool secrets for the probe credential", "pool", pool, "err", err)
		return
	}
	var s events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &s); err != nil {
		return // poolSecrets reports it
	}
	if s.Password == "" && len(s.External) == 0 {
		if err := r.kv.Purge(ctx, pool); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			c.log.Warn("remove the credential of a pool without password", "reader", r.name, "pool", pool, "err", err)
		}
		return
	}
	if have, err := r.kv.Get(ctx, pool); err == nil {
		var c events.ProbeCredential
		if json.Unmarshal(have.Value(), &c) == nil && c.Sealed.To == to && c.Revision == s.Revision {
			return
		}
	}
	plain, _ := json.Marshal(events.ProbeSecret{Pool: pool, Password: s.Password, External: s.External})
	box, err := seal.Seal(plain, to)
	clear(plain)
	if err != nil {
		c.log.Warn("seal the credential", "reader", r.name, "pool", pool, "err", err)
		return
	}
	raw, _ := json.Marshal(events.ProbeCredential{Revision: s.Revision, Sealed: *box})
	if _, err := r.kv.Put(ctx, pool, raw); err != nil {
		c.log.Warn("store the credential", "reader", r.name, "bucket", r.bucket, "pool", pool, "err", err)
		return
	}
	c.log.Debug("credential sealed to the announced key", "reader", r.name, "bucket", r.bucket, "pool", pool, "revision", s.Revision)
}

// removeProbeCred purges r's credential of a pool deleted at revision
// rev; one sealed from a later revision (the pool was applied again) is
// kept.
func (c *credentials) removeProbeCred(ctx context.Context, r *credReader, pool string, rev int) {
	e, err := r.kv.Get(ctx, pool)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return
	}
	if err != nil {
		c.log.Warn("read the credential for removal", "reader", r.name, "pool", pool, "err", err)
		return
	}
	var cred events.ProbeCredential
	if json.Unmarshal(e.Value(), &cred) == nil && cred.Revision > rev {
		return
	}
	if err := r.kv.Purge(ctx, pool, jetstream.LastRevision(e.Revision())); err != nil {
		c.log.Debug("purge the credential", "reader", r.name, "pool", pool, "err", err)
		return
	}
	c.log.Info("credential removed", "reader", r.name, "bucket", r.bucket, "pool", pool, "revision", rev)
}

// removeCreds purges every reader's credential of a pool deleted at
// revision rev.
func (c *credentials) removeCreds(ctx context.Context, pool string, rev int) {
	for _, r := range c.readers {
		c.removeProbeCred(ctx, r, pool, rev)
	}
}
