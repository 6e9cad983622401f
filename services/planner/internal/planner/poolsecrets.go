package planner

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// removeSecrets purges from fleet-secrets the secrets of a pool deleted at
// revision rev. Secrets of a later revision belong to an apply that brought
// the pool back and are kept; the purge expects the key revision it read,
// so such an apply racing the removal is never undone. Called after the
// deleted event is stored, so a crash in between leaves secrets that the
// next pool.delete removes.
func (b backend) removeSecrets(ctx context.Context, pool string, rev int) *api.APIError {
	for range maxConflictRetries {
		e, err := b.secrets.kv.Get(ctx, pool)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			b.secrets.creds.removeCreds(ctx, pool, rev)
			return nil
		}
		if err != nil {
			b.log.WarnContext(ctx, "read pool secrets for removal", "pool", pool, "err", err)
			return api.Internal("the pool is deleted but its secrets could not be read for removal; send pool.delete again")
		}
		var have events.PoolSecrets
		if json.Unmarshal(e.Value(), &have) == nil && have.Revision > rev {
			return nil
		}
		err = b.secrets.kv.Purge(ctx, pool, jetstream.LastRevision(e.Revision()))
		if err == nil {
			b.log.InfoContext(ctx, "pool secrets removed", "pool", pool, "revision", rev)
			b.secrets.creds.removeCreds(ctx, pool, rev)
			return nil
		}
		// Most likely the key changed since it was read: read it again.
		b.log.DebugContext(ctx, "purge pool secrets", "pool", pool, "err", err)
	}
	return api.Internal("the pool is deleted but its secrets could not be removed; send pool.delete again")
}

// ensureSecrets rewrites the secrets of an unchanged re-apply when the
// stored ones do not match (a write that raced or a lost bucket), so a
// re-apply always repairs them.
func (b backend) ensureSecrets(ctx context.Context, pool string, rev int, sec events.PoolSecrets) *api.APIError {
	e, err := b.secrets.kv.Get(ctx, pool)
	if err == nil {
		var have events.PoolSecrets
		if json.Unmarshal(e.Value(), &have) == nil && have.Digest(b.secrets.digestKey) == sec.Digest(b.secrets.digestKey) {
			return nil
		}
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		return api.Internal("could not read the pool's secrets; retry")
	}
	sec.Revision = rev
	raw, _ := json.Marshal(sec)
	if _, err := b.secrets.kv.Put(ctx, pool, raw); err != nil {
		return api.Internal("could not store the pool's secrets; retry")
	}
	return nil
}

// DigestKeyName is the fleet-secrets key holding the HMAC key of the
// secrets digests recorded in events. Pool names cannot start with '_', so
// it never collides with a pool's secrets.
const DigestKeyName = "_digest-key"

// loadDigestKey returns the digest key, creating it on first start. Every
// replica ends with the same key: it is created with KV Create, and a
// replica that lost the race reads the winner's.
func loadDigestKey(ctx context.Context, kv jetstream.KeyValue) ([]byte, error) {
	for range maxConflictRetries {
		e, err := kv.Get(ctx, DigestKeyName)
		if err == nil {
			if len(e.Value()) < events.DigestKeyLen {
				return nil, fmt.Errorf("fleet-secrets key %s holds %d bytes, want %d: delete it to have a new one made (every pool is then re-applied with a new digest)", DigestKeyName, len(e.Value()), events.DigestKeyLen)
			}
			return e.Value(), nil
		}
		if !errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil, fmt.Errorf("read the digest key: %w", err)
		}
		key := make([]byte, events.DigestKeyLen)
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		if _, err := kv.Create(ctx, DigestKeyName, key); err == nil {
			return key, nil
		} else if !errors.Is(err, jetstream.ErrKeyExists) {
			return nil, fmt.Errorf("create the digest key: %w", err)
		}
	}
	return nil, errors.New("the digest key keeps changing in fleet-secrets")
}
