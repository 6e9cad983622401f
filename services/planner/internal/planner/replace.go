package planner

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// errNoTarget means no live target can take a replacement now.
var errNoTarget = errors.New("no live target can take a replacement now")

// requestReplacement decides, for an API request, a new proxy of x's pool
// that replaces x, and sends its create command. The reconciler then
// counts the new proxy instead of x and retires x once the new one is
// ready (see retireCondemned). A proxy that already has a live replacement
// gets no second one. It returns the replacement's id and the sequence of
// its requested event (0 when one existed).
func (p *Planner) requestReplacement(ctx context.Context, x Proxy, why string) (string, uint64, error) {
	r := p.roundOf(map[string]bool{x.Pool: true}, false)
	if y, ok := r.replacement(x); ok {
		return y.ID, 0, nil
	}
	var pool Pool
	found := false
	for _, ps := range r.pools {
		if ps.pool.Name == x.Pool {
			pool, found = ps.pool, true
		}
	}
	if !found || pool.Deleted {
		return "", 0, errors.New("the proxy's pool is deleted; nothing replaces it")
	}
	a, ok := p.place(r, pool)
	if !ok {
		m := p.placeWhy(r, pool)
		return "", 0, fmt.Errorf("%w (%s: %s)", errNoTarget, m.reason, m.message)
	}
	sec, ok := p.poolSecrets(ctx, r, pool)
	if !ok {
		return "", 0, errors.New("the pool's secrets cannot be read or do not match its revision; re-apply the pool")
	}
	if !sec.Empty() && a.XKey == "" {
		return "", 0, fmt.Errorf("%w (%s: target %s/%s announced no curve key to seal the pool's secrets to)", errNoTarget, events.ReasonSecretsUnavailable, a.Entry, a.Target)
	}
	req := newRequest(pool, a, x.ID, why)
	ctx, span := p.startRequest(ctx, req)
	defer span.End()
	seq, err := p.appendEvent(ctx, events.AggregateProxy, req.id, events.ProxyRequested, req.msgID, req.data, &bus.Expect{Seq: 0})
	if err != nil {
		return "", 0, err
	}
	p.log.InfoContext(ctx, "decided", req.logArgs()...)
	p.m.replaced(ctx, x.Pool, why)
	cmd, err := createCommand(req.id, req.data, 1, sec, a.XKey)
	if err != nil {
		p.log.WarnContext(ctx, "create command not sent: its secrets cannot be sealed; it is issued again after the create timeout", "proxy", req.id, "err", err)
		return req.id, seq, nil
	}
	if err := p.publishCommand(ctx, pending{create: &cmd}); err != nil {
		// The decision stands; the reconciler re-issues the create when
		// the proxy stays requested.
		p.log.WarnContext(ctx, "publish create", "proxy", cmd.ProxyID, "err", err)
	}
	return req.id, seq, nil
}

// recycle replaces proxy id surge first: a replacement is requested now and
// id is retired once it is ready. Repeating it changes nothing.
func (p *Planner) recycle(ctx context.Context, id string) (any, *api.APIError) {
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))
	x, aerr := p.lookupProxy(ctx, id)
	if aerr != nil {
		return nil, aerr
	}
	if !isActive(x.State) {
		return x.ProxyView, nil
	}
	_, seq, err := p.requestReplacement(ctx, x, "recycled by operator")
	if errors.Is(err, errNoTarget) {
		return nil, &api.APIError{Status: "503", Code: api.CodeUnavailable,
			Message: "id: " + err.Error() + `; retry later, or recycle with {"now":true} to retire the proxy at once`}
	}
	if err != nil {
		p.log.ErrorContext(ctx, "request replacement", "proxy", id, "err", err)
		return nil, internal("id: could not request a replacement; retry")
	}
	if err := p.waitSeq(ctx, seq); err != nil {
		return nil, internal("replacement recorded but not yet visible; get the proxy again")
	}
	x, aerr = p.lookupProxy(ctx, id)
	if aerr != nil {
		return nil, aerr
	}
	return x.ProxyView, nil
}
