package planner

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
)

// removeSecrets purges from fleet-secrets the secrets of a pool deleted at
// revision rev. Secrets of a later revision belong to an apply that brought
// the pool back and are kept; the purge expects the key revision it read,
// so such an apply racing the removal is never undone. Called after the
// deleted event is stored, so a crash in between leaves secrets that the
// next pool.delete removes.
func (p *Planner) removeSecrets(ctx context.Context, pool string, rev int) *APIError {
	for range maxConflictRetries {
		e, err := p.secrets.Get(ctx, pool)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			p.log.WarnContext(ctx, "read pool secrets for removal", "pool", pool, "err", err)
			return internal("the pool is deleted but its secrets could not be read for removal; send pool.delete again")
		}
		var have events.PoolSecrets
		if json.Unmarshal(e.Value(), &have) == nil && have.Revision > rev {
			return nil
		}
		err = p.secrets.Purge(ctx, pool, jetstream.LastRevision(e.Revision()))
		if err == nil {
			p.log.InfoContext(ctx, "pool secrets removed", "pool", pool, "revision", rev)
			return nil
		}
		// Most likely the key changed since it was read: read it again.
		p.log.DebugContext(ctx, "purge pool secrets", "pool", pool, "err", err)
	}
	return internal("the pool is deleted but its secrets could not be removed; send pool.delete again")
}
