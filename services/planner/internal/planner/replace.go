package planner

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/services/planner/internal/decide"
)

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
	found := false
	for _, ps := range r.pools {
		if ps.pool.Name == x.Pool {
			pool, found = ps.pool, true
		}
	}
	if !found || pool.Deleted {
		return "", nil, errors.New("the proxy's pool is deleted; nothing replaces it")
	}
	pl := r.placement(pool.Name, pool.Spec.Provider)
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

// recycle replaces proxy id surge first: a replacement is requested now and
// id is retired once it is ready. Repeating it changes nothing.
func (p *Planner) recycle(ctx context.Context, id string) (any, *api.APIError) {
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))
	for range maxConflictRetries {
		x, aerr := p.lookupProxy(ctx, id)
		if aerr != nil {
			return nil, aerr
		}
		if !decide.IsActive(x.State) {
			return x.ProxyView, nil
		}
		var u *unit
		var err error
		var lerr *api.APIError
		if aerr := p.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
			// Looked up again on the leader: its view is the one that
			// decides.
			if x, lerr = p.lookupProxy(ctx, id); lerr == nil && decide.IsActive(x.State) {
				_, u, err = rc.requestReplacement(ctx, f, x, "recycled by operator")
			}
		}); aerr != nil {
			return nil, aerr
		}
		switch {
		case lerr != nil:
			return nil, lerr
		case errors.Is(err, errNoTarget):
			return nil, &api.APIError{Status: "503", Code: api.CodeUnavailable,
				Message: "id: " + err.Error() + `; retry later, or recycle with {"now":true} to retire the proxy at once`}
		case err != nil:
			p.log.ErrorContext(ctx, "request replacement", "proxy", id, "err", err)
			return nil, internal("id: could not request a replacement; retry")
		case u != nil && errors.Is(u.err, bus.ErrConflict):
			continue
		case u != nil && u.err != nil:
			p.log.ErrorContext(ctx, "request replacement", "proxy", id, "err", u.err)
			return nil, internal("id: could not request a replacement; retry")
		}
		if u != nil {
			if err := p.waitSeq(ctx, u.seq); err != nil {
				return nil, internal("replacement recorded but not yet visible; get the proxy again")
			}
		}
		x, aerr = p.lookupProxy(ctx, id)
		if aerr != nil {
			return nil, aerr
		}
		return x.ProxyView, nil
	}
	return nil, &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the proxy keeps changing concurrently; retry"}
}
