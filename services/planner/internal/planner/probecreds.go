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

// probeCredsSweep is how often every pool's probe credential is checked
// against fleet-secrets and health's key, whatever changed: it repairs a
// write that raced a key change or an apply.
const probeCredsSweep = 30 * time.Second

// probeCredsLoop keeps fleet-probe-creds current, so health probes each
// pool's proxies with its password without reading fleet-secrets: at
// start, whenever health announces a new key, and every probeCredsSweep.
func (p *Planner) probeCredsLoop(ctx context.Context) {
	t := time.NewTicker(probeCredsSweep)
	defer t.Stop()
	var w jetstream.KeyWatcher
	defer func() { bus.StopWatch(w) }()
	for {
		if w == nil {
			var err error
			if w, err = p.probeCreds.Watch(ctx, events.ProbeRecipientKey, jetstream.UpdatesOnly()); err != nil {
				p.log.Warn("watch health's probe key", "err", err)
				w = nil
			}
		}
		p.syncProbeCreds(ctx)
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

// probeRecipient returns the curve key health announced, "" when none.
func (p *Planner) probeRecipient(ctx context.Context) (string, error) {
	e, err := p.probeCreds.Get(ctx, events.ProbeRecipientKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	to := string(e.Value())
	if err := seal.CheckPublic(to); err != nil {
		p.log.Warn("fleet-probe-creds: health's announced key is not a curve key; probe passwords are not sealed until it is", "key", events.ProbeRecipientKey)
		return "", nil
	}
	return to, nil
}

// syncProbeCreds brings every pool's probe credential up to date, and
// removes those of deleted pools.
func (p *Planner) syncProbeCreds(ctx context.Context) {
	to, err := p.probeRecipient(ctx)
	if err != nil {
		p.log.Warn("read health's probe key", "err", err)
		return
	}
	type poolRev struct {
		name    string
		deleted bool
		rev     int
	}
	p.mu.Lock()
	pools := make([]poolRev, 0, len(p.st.pools))
	for name, pl := range p.st.pools {
		pools = append(pools, poolRev{name: name, deleted: pl.Deleted, rev: pl.Revision})
	}
	p.mu.Unlock()
	for _, pl := range pools {
		if ctx.Err() != nil {
			return
		}
		if pl.deleted {
			p.removeProbeCred(ctx, pl.name, pl.rev)
			continue
		}
		if to != "" {
			p.syncProbeCred(ctx, pl.name, to)
		}
	}
}

// probeCredNow brings an applied pool's probe credential up to date at
// once, so health probes with a new password without waiting for the
// sweep. A failure only delays it to the sweep.
func (p *Planner) probeCredNow(ctx context.Context, pool string) {
	to, err := p.probeRecipient(ctx)
	if err != nil || to == "" {
		return
	}
	p.syncProbeCred(ctx, pool, to)
}

// syncProbeCred seals the pool's password from fleet-secrets to health's
// key to, unless the stored credential already is that. A pool without a
// password has no credential.
func (p *Planner) syncProbeCred(ctx context.Context, pool, to string) {
	e, err := p.secrets.Get(ctx, pool)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return
	}
	if err != nil {
		p.log.Warn("read pool secrets for the probe credential", "pool", pool, "err", err)
		return
	}
	var s events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &s); err != nil {
		return // poolSecrets reports it
	}
	if s.Password == "" {
		if err := p.probeCreds.Purge(ctx, pool); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			p.log.Warn("remove the probe credential of a pool without password", "pool", pool, "err", err)
		}
		return
	}
	if have, err := p.probeCreds.Get(ctx, pool); err == nil {
		var c events.ProbeCredential
		if json.Unmarshal(have.Value(), &c) == nil && c.Sealed.To == to && c.Revision == s.Revision {
			return
		}
	}
	plain, _ := json.Marshal(events.ProbeSecret{Pool: pool, Password: s.Password})
	box, err := seal.Seal(plain, to)
	clear(plain)
	if err != nil {
		p.log.Warn("seal the probe credential", "pool", pool, "err", err)
		return
	}
	raw, _ := json.Marshal(events.ProbeCredential{Revision: s.Revision, Sealed: *box})
	if _, err := p.probeCreds.Put(ctx, pool, raw); err != nil {
		p.log.Warn("store the probe credential", "pool", pool, "err", err)
		return
	}
	p.log.Debug("probe credential sealed to health's key", "pool", pool, "revision", s.Revision)
}

// removeProbeCred purges the probe credential of a pool deleted at
// revision rev; one sealed from a later revision (the pool was applied
// again) is kept.
func (p *Planner) removeProbeCred(ctx context.Context, pool string, rev int) {
	e, err := p.probeCreds.Get(ctx, pool)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return
	}
	if err != nil {
		p.log.Warn("read the probe credential for removal", "pool", pool, "err", err)
		return
	}
	var c events.ProbeCredential
	if json.Unmarshal(e.Value(), &c) == nil && c.Revision > rev {
		return
	}
	if err := p.probeCreds.Purge(ctx, pool, jetstream.LastRevision(e.Revision())); err != nil {
		p.log.Debug("purge the probe credential", "pool", pool, "err", err)
		return
	}
	p.log.Info("probe credential removed", "pool", pool, "revision", rev)
}
