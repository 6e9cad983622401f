package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// The operator's intents: pool.apply and pool.delete record what the
// operator wants, and any replica takes them (see writer.go).

// maxConflictRetries bounds how often one request re-reads and re-decides.
const maxConflictRetries = 5

// errPoolConflict answers an intent whose pool kept changing.
func errPoolConflict() *api.APIError {
	return api.Conflict("the pool keeps changing concurrently; retry")
}

// poolCopy returns a copy of pool name as the projection holds it, and
// whether it holds one.
func (b backend) poolCopy(name string) (Pool, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if pl := b.st.pools[name]; pl != nil {
		return *pl, true
	}
	return Pool{}, false
}

// ApplyPool implements [apiserver.Writer]: it writes the spec's secrets to
// fleet-secrets and appends pool applied with the next revision. An
// unchanged spec appends nothing (and repairs its secrets). The secrets go
// first, so that a create never finds the event without them; when the
// event is then not recorded, the secrets the pool had are put back, so a
// refused or failed apply leaves nothing behind.
func (b backend) ApplyPool(ctx context.Context, spec events.PoolSpec) (_ api.PoolView, aerr *api.APIError) {
	if aerr := b.expandExternal(ctx, &spec); aerr != nil {
		return api.PoolView{}, aerr
	}
	pub, sec := spec.Public(), spec.Secrets()
	digest := sec.Digest(b.secrets.digestKey)
	pubJSON, _ := json.Marshal(pub)
	// prev is what fleet-secrets held for the pool before this request
	// (nil: nothing), put the revision of this request's last write.
	var prev jetstream.KeyValueEntry
	var read, current bool
	var put uint64
	defer func() {
		if aerr != nil && put != 0 {
			b.restoreSecrets(spec.Name, prev, put)
		}
	}()
	for range maxConflictRetries {
		if aerr := b.fallbackCycle(spec); aerr != nil {
			return api.PoolView{}, aerr
		}
		cur, ok := b.poolCopy(spec.Name)
		if ok && !cur.Deleted && cur.Revision > 0 && sec.Matches(b.secrets.digestKey, cur.SecretsDigest) {
			curJSON, _ := json.Marshal(cur.Spec)
			if bytes.Equal(curJSON, pubJSON) {
				// Unchanged is acknowledged without a write, so it is
				// judged on the log as it is now: this replica's
				// projection may lag (a replica just reconnected after a
				// partition), and would acknowledge a spec the log has
				// since replaced. Read up to the pool's last event, then
				// look again.
				if !current {
					if err := b.caughtUpWithLog(ctx, spec.Name); err != nil {
						b.log.WarnContext(ctx, "pool apply: the projection is behind the log", "pool", spec.Name, "err", err)
						return api.PoolView{}, api.Unavailable("this planner replica is behind the event log; nothing was applied, retry")
					}
					current = true
					continue
				}
				if aerr := b.ensureSecrets(ctx, spec.Name, cur.Revision, sec); aerr != nil {
					return api.PoolView{}, aerr
				}
				b.secrets.creds.probeCredNow(ctx, spec.Name)
				return b.poolView(spec.Name), nil
			}
		}
		rev := cur.Revision + 1
		sec.Revision = rev
		raw, _ := json.Marshal(sec)
		if !read {
			e, err := b.secrets.kv.Get(ctx, spec.Name)
			if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
				return api.PoolView{}, api.Internal("could not read the pool's secrets; nothing was applied, retry")
			}
			prev, read = e, true
		}
		written, err := b.secrets.kv.Put(ctx, spec.Name, raw)
		if err != nil {
			return api.PoolView{}, api.Internal("could not store the pool's secrets; nothing was applied, retry")
		}
		put = written
		data := events.PoolAppliedData{Spec: pub, Revision: rev, SecretsDigest: digest}
		seq, err := b.appendIntent(ctx, spec.Name, events.PoolApplied, decisionID(spec.Name, events.PoolApplied, uint64(rev), data), data, cur.LastSeq,
			[]any{"pool", spec.Name, "decision", events.PoolApplied, "revision", rev})
		if errors.Is(err, bus.ErrConflict) {
			if err := b.catchUp(ctx, events.AggregatePool, spec.Name); err != nil {
				return api.PoolView{}, api.Internal("could not re-read the pool after a concurrent change; retry")
			}
			continue
		}
		if err != nil {
			b.log.ErrorContext(ctx, "append pool applied", "pool", spec.Name, "err", err)
			return api.PoolView{}, api.Internal("could not record the pool; retry")
		}
		b.log.InfoContext(ctx, "pool applied", "pool", spec.Name, "revision", rev, "size", spec.Size, "entry", spec.Provider)
		if err := b.waitSeq(ctx, seq); err != nil {
			return api.PoolView{}, api.Internal("pool recorded but not yet visible; get it again")
		}
		b.secrets.creds.probeCredNow(ctx, spec.Name)
		return b.poolView(spec.Name), nil
	}
	return api.PoolView{}, errPoolConflict()
}

// caughtUpWithLog waits until the projection holds pool name's last event
// as the stream leader has it.
func (b backend) caughtUpWithLog(ctx context.Context, name string) error {
	seq, err := b.store.LastSeq(ctx, events.AggregatePool, name)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return b.waitSeq(wctx, seq)
}

// fallbackCycle refuses a spec whose gateway.fallback leads back to the
// pool through the fallbacks the other pools' recorded specs name
// (deleted pools' do not count): the gateway would go round it on every
// request that needs a later tier. It is checked against the projection
// before anything is written; two applies that close a cycle between
// them concurrently are still stopped by the gateway's per-request guard.
func (b backend) fallbackCycle(spec events.PoolSpec) *api.APIError {
	fb := spec.Gateway.FallbackPools()
	if len(fb) == 0 {
		return nil
	}
	b.mu.Lock()
	i, cycle, found := decide.FallbackCycle(spec.Name, fb, func(name string) []string {
		if p := b.st.pools[name]; p != nil && !p.Deleted && p.Revision > 0 {
			return p.Spec.Gateway.FallbackPools()
		}
		return nil
	})
	b.mu.Unlock()
	if !found {
		return nil
	}
	return api.Invalid([]events.FieldError{{Field: fmt.Sprintf("gateway.fallback[%d]", i),
		Reason: "closes a fallback cycle " + decide.CycleText(cycle) + "; remove the fallback on one of these pools first", Value: fb[i]}})
}

// restoreSecrets puts back what fleet-secrets held for pool (prev, nil
// for nothing) before an apply whose event was not recorded, unless the
// key changed since that apply wrote it (revision put): a later write is
// another apply's.
func (b backend) restoreSecrets(pool string, prev jetstream.KeyValueEntry, put uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if prev == nil {
		err = b.secrets.kv.Purge(ctx, pool, jetstream.LastRevision(put))
	} else {
		_, err = b.secrets.kv.Update(ctx, pool, prev.Value(), put)
	}
	if err != nil {
		b.log.Warn("the pool's secrets of an apply that was not recorded could not be put back; the next apply or pool.delete replaces them", "pool", pool, "err", err)
	}
}

// DeletePool implements [apiserver.Writer]: it appends pool deleted, then
// removes the pool's secrets from fleet-secrets; the reconciler retires
// every proxy of the pool (deletes need no secrets). Deleting a deleted
// pool appends nothing and removes secrets a crash left behind.
func (b backend) DeletePool(ctx context.Context, name string) (api.PoolView, *api.APIError) {
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("pool", name))
	for range maxConflictRetries {
		cur, ok := b.poolCopy(name)
		if !ok || cur.Revision == 0 {
			return api.PoolView{}, api.NotFound("name", "unknown pool", name)
		}
		if cur.Deleted {
			// A repeat after a crash between the event and the removal.
			if aerr := b.removeSecrets(ctx, name, cur.Revision); aerr != nil {
				return api.PoolView{}, aerr
			}
			return b.poolView(name), nil
		}
		rev := cur.Revision + 1
		data := events.PoolDeletedData{Revision: rev}
		seq, err := b.appendIntent(ctx, name, events.PoolDeleted, decisionID(name, events.PoolDeleted, uint64(rev), data), data, cur.LastSeq,
			[]any{"pool", name, "decision", events.PoolDeleted, "revision", rev})
		if errors.Is(err, bus.ErrConflict) {
			if err := b.catchUp(ctx, events.AggregatePool, name); err != nil {
				return api.PoolView{}, api.Internal("could not re-read the pool after a concurrent change; retry")
			}
			continue
		}
		if err != nil {
			b.log.ErrorContext(ctx, "append pool deleted", "pool", name, "err", err)
			return api.PoolView{}, api.Internal("could not record the deletion; retry")
		}
		b.log.InfoContext(ctx, "pool deleted", "pool", name, "revision", rev)
		if aerr := b.removeSecrets(ctx, name, rev); aerr != nil {
			return api.PoolView{}, aerr
		}
		if err := b.waitSeq(ctx, seq); err != nil {
			return api.PoolView{}, api.Internal("deletion recorded but not yet visible; get the pool again")
		}
		return b.poolView(name), nil
	}
	return api.PoolView{}, errPoolConflict()
}
