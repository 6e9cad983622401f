package planner

import (
	"context"
	"errors"
	"fmt"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/apiserver"
	"proxyfleet/services/planner/internal/decide"
)

// The operator's decisions: proxy.delete, proxy.recycle, proxy.report-ban
// and instance.delete are decided from the fleet's state, so the leader
// alone takes them, as jobs on its reconciler (see writer.go).

// errProxyConflict answers a decision whose proxy kept changing.
func errProxyConflict() *api.APIError {
	return api.Conflict("the proxy keeps changing concurrently; retry")
}

// Retire implements [apiserver.Writer]: it retires one proxy and sends its
// delete command, or, with SkipCleanup, retires and abandons it without
// touching the instance; with Replace it also requests the proxy's
// replacement, in the same leader job once the retirement is stored (a
// ban: the pool does not wait for a round; when no target can take one
// now, the proxy is retired all the same and the pool's Placed condition
// says why it stays short). The reconciler replaces the proxy if its pool
// still wants it. Repeating the request changes nothing.
func (b backend) Retire(ctx context.Context, id string, r apiserver.Retirement) (events.ProxyView, *api.APIError) {
	// done reports whether x needs no decision: finished, or already
	// retiring the way the operator asks.
	done := func(x Proxy) bool {
		return events.IsTerminal(x.State) || x.State == events.ProxyRetiring && (!r.SkipCleanup || x.SkipCleanup)
	}
	for range maxConflictRetries {
		x, aerr := b.lookupProxy(ctx, id)
		if aerr != nil || done(x) {
			return x.ProxyView, aerr
		}
		if externalOf(x) {
			// Nothing can replace an external proxy: a ban disables it,
			// anything else is refused.
			if r.Replace {
				return b.disableBanned(ctx, id, r.Reason)
			}
			return events.ProxyView{}, errExternalNotReplaced(id)
		}
		var u *unit
		var lerr *api.APIError
		if aerr := b.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
			// Looked up again on the leader: its view is the one that
			// decides.
			if x, lerr = b.lookupProxy(ctx, id); lerr != nil || done(x) {
				return
			}
			if x.State == events.ProxyRetiring {
				// Already being deleted; the operator now wants it abandoned.
				ab := events.ProxyAbandonedData{Reason: r.Reason}
				u = rc.decide(ctx, f, x, events.ProxyAbandoned, decisionID(x.ID, events.ProxyAbandoned, x.LastSeq, ab), ab, nil)
				return
			}
			replaced := ""
			if reasonClass(r.Reason) == "recycled" {
				// The fill replaces it.
				replaced = r.Reason
			}
			u = rc.retire(ctx, nil, f, x, r.Reason, replaced, r.SkipCleanup)
			// The replacement only once the retirement is stored, and
			// before any round: a refused batch is split, so in one
			// batch a retirement refused for a concurrent change could
			// lose while its replacement was stored, and the retry
			// (that replacement not yet folded) request another: the
			// pool two over its size. A crash between the two leaves
			// the pool one short, which the next round fills.
			f.wait()
			if r.Replace && u.err == nil {
				if _, _, err := rc.requestReplacement(ctx, f, x, r.Reason); err != nil {
					b.log.WarnContext(ctx, "no replacement for the proxy yet; retiring it anyway", "proxy", x.ID, "err", err)
				}
			}
		}); aerr != nil {
			return events.ProxyView{}, aerr
		}
		if lerr != nil {
			return events.ProxyView{}, lerr
		}
		if u != nil {
			if errors.Is(u.err, bus.ErrConflict) {
				if err := b.catchUp(ctx, events.AggregateProxy, id); err != nil {
					return events.ProxyView{}, api.Internal("could not re-read the proxy after a concurrent change; retry")
				}
				continue
			}
			if u.err != nil {
				b.log.ErrorContext(ctx, "proxy decision", "proxy", id, "err", u.err)
				return events.ProxyView{}, api.Internal("could not record the decision; retry")
			}
			b.log.InfoContext(ctx, "proxy retired by operator", "proxy", id, "pool", x.Pool, "reason", r.Reason)
			if err := b.waitSeq(ctx, u.seq); err != nil {
				return events.ProxyView{}, api.Internal("decision recorded but not yet visible; get the proxy again")
			}
		}
		return b.Proxy(ctx, id)
	}
	return events.ProxyView{}, errProxyConflict()
}

// Recycle implements [apiserver.Writer]: it replaces proxy id surge first,
// a replacement requested now and id retired once it is ready. Repeating
// it changes nothing.
func (b backend) Recycle(ctx context.Context, id string) (events.ProxyView, *api.APIError) {
	for range maxConflictRetries {
		x, aerr := b.lookupProxy(ctx, id)
		if aerr == nil && externalOf(x) {
			return events.ProxyView{}, errExternalNotReplaced(id)
		}
		if aerr != nil || !decide.IsActive(x.State) {
			return x.ProxyView, aerr
		}
		var u *unit
		var err error
		var lerr *api.APIError
		if aerr := b.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
			// Looked up again on the leader: its view is the one that
			// decides.
			if x, lerr = b.lookupProxy(ctx, id); lerr == nil && decide.IsActive(x.State) {
				_, u, err = rc.requestReplacement(ctx, f, x, "recycled by operator")
			}
		}); aerr != nil {
			return events.ProxyView{}, aerr
		}
		switch {
		case lerr != nil:
			return events.ProxyView{}, lerr
		case errors.Is(err, errNoTarget):
			return events.ProxyView{}, api.Unavailable("id: " + err.Error() + `; retry later, or recycle with {"now":true} to retire the proxy at once`)
		case err != nil:
			b.log.ErrorContext(ctx, "request replacement", "proxy", id, "err", err)
			return events.ProxyView{}, api.Internal("id: could not request a replacement; retry")
		case u != nil && errors.Is(u.err, bus.ErrConflict):
			continue
		case u != nil && u.err != nil:
			b.log.ErrorContext(ctx, "request replacement", "proxy", id, "err", u.err)
			return events.ProxyView{}, api.Internal("id: could not request a replacement; retry")
		}
		if u != nil {
			if err := b.waitSeq(ctx, u.seq); err != nil {
				return events.ProxyView{}, api.Internal("replacement recorded but not yet visible; get the proxy again")
			}
		}
		return b.Proxy(ctx, id)
	}
	return events.ProxyView{}, errProxyConflict()
}

// errNoTarget means no live target can take a replacement now.
var errNoTarget = errors.New("no live target can take a replacement now")

// requestReplacement decides, for an operator's request on the leader's
// flight f, a new proxy of x's pool that replaces x; its create command is
// sent once it is stored. The reconciler then counts the new proxy instead
// of x and retires x once the new one is ready. A proxy that already has a
// live replacement gets no second one: that one is returned, with a nil
// unit.
func (rc *reconciler) requestReplacement(ctx context.Context, f *flight, x Proxy, why string) (string, *unit, error) {
	r := rc.roundOf(map[string]bool{x.Pool: true}, false)
	if y, ok := r.replacement(x); ok {
		return y.ID, nil, nil
	}
	var pool Pool
	var members []decide.Proxy
	found := false
	for _, ps := range r.pools {
		if ps.pool.Name == x.Pool {
			pool, members, found = ps.pool, ps.members, true
		}
	}
	if !found || pool.Deleted {
		return "", nil, errors.New("the proxy's pool is deleted; nothing replaces it")
	}
	pl := r.placement(pool.Name, pool.Spec.PlacementEntries())
	if pool.Spec.Placement != nil {
		pl.Record(members)
		pl.Leave(x.Proxy)
	}
	a, ok := decide.Place(pl, &pool.Pool)
	if !ok {
		m := decide.Why(pl, &pool.Pool)
		return "", nil, fmt.Errorf("%w (%s: %s)", errNoTarget, m.Reason, m.Message)
	}
	u, miss := rc.create(ctx, r, f, pool, a, x.ID, why)
	if miss != nil {
		return "", nil, fmt.Errorf("%w (%s: %s)", errNoTarget, miss.Reason, miss.Message)
	}
	return "", u, nil
}

// instanceDeleteReason is the retiring reason recorded when an operator
// deletes an instance through instance.delete.
const instanceDeleteReason = "instance deleted by operator"

// DeleteInstance implements [apiserver.Writer]: on the leader, it makes
// the last event of the proxy inst's marker names retiring (see
// [backend.retireInstance]) and sends the delete command of inst.
func (b backend) DeleteInstance(ctx context.Context, entry, target string, inst agent.Instance) (int, *api.APIError) {
	id := inst.Marker.ProxyID
	var attempt int
	var aerr *api.APIError
	var sent *commandInFlight
	if lerr := b.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
		if attempt, aerr = b.retireInstance(ctx, f, entry, target, id); aerr != nil {
			return
		}
		cmd := events.DeleteCommand{
			ProxyID: id, Pool: inst.Marker.Pool, Entry: entry, Target: target, Instance: inst.Name,
			ProviderID: inst.ProviderID, Attempt: attempt, Reason: instanceDeleteReason,
		}
		sent = f.command(ctx, pending{del: &cmd})
	}); lerr != nil {
		return 0, lerr
	}
	if aerr != nil {
		return 0, aerr
	}
	if sent == nil || sent.err != nil {
		b.log.WarnContext(ctx, "instance.delete: publish delete", "proxy", id)
		return 0, api.Internal("the deletion is recorded but its command could not be sent; send instance.delete again")
	}
	return attempt, nil
}

// retireInstance makes the proxy's last event retiring (appending it,
// expecting the aggregate's last sequence, unless it already is) and
// returns the delete attempt, as [decide.DeleteInstance] says: the number of
// retiring events, so a repeated request re-sends the same command and a
// request after a failed delete sends a new one. It is the garbage
// collector's rule for orphans (see [reconciler.deleteOrphan]), open here
// to abandoned proxies too.
func (b backend) retireInstance(ctx context.Context, f *flight, entry, target, id string) (int, *api.APIError) {
	for range maxConflictRetries {
		evs, err := b.store.Load(ctx, events.AggregateProxy, id)
		if err != nil {
			b.log.WarnContext(ctx, "instance.delete: read the proxy's events", "proxy", id, "err", err)
			return 0, api.Internal("could not read the proxy's events; retry")
		}
		rd, _ := decide.DeleteInstance(entry, target, factsOf(evs))
		if !rd.Retire {
			return rd.Attempt, nil
		}
		pool := ""
		if x, aerr := b.lookupProxy(ctx, id); aerr == nil {
			pool = x.Pool
		}
		d := events.ProxyRetiringData{Reason: instanceDeleteReason}
		u := f.decide(ctx, nil, pool, events.AggregateProxy, id, &bus.Expect{Seq: rd.LastSeq},
			[]bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(id, events.ProxyRetiring, rd.LastSeq, d), Data: d}},
			[]any{"proxy", id, "decision", events.ProxyRetiring, "reason", instanceDeleteReason}, nil)
		f.wait()
		if errors.Is(u.err, bus.ErrConflict) {
			continue // re-read: the collector or a repeated request got there first
		}
		if u.err != nil {
			b.log.ErrorContext(ctx, "instance.delete: append retiring", "proxy", id, "err", u.err)
			return 0, api.Internal("could not record the deletion; retry")
		}
		return rd.Attempt, nil
	}
	return 0, errProxyConflict()
}
