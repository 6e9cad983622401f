package planner

import (
	"context"
	"log/slog"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// recallProxy folds proxy id from its events in the log: the answer about
// a proxy that is not in memory (one that finished long ago, or one whose
// events the projection has not read yet). The view is what the
// projection held when the proxy finished, except that a note of its
// replacement (replacedBy, replaceReason), which another proxy's event
// records, is not recalled. It returns a 422 when the log holds no such
// proxy.
func (p *Planner) recallProxy(ctx context.Context, id string) (Proxy, *api.APIError) {
	last, err := p.store.Last(ctx, events.AggregateProxy, id)
	if err != nil {
		p.log.WarnContext(ctx, "read a proxy's last event", "proxy", id, "err", err)
		return Proxy{}, internal("could not read the proxy's events; retry")
	}
	if last != nil {
		evs, err := p.store.Load(ctx, events.AggregateProxy, id)
		if err != nil {
			p.log.WarnContext(ctx, "read a proxy's events", "proxy", id, "err", err)
			return Proxy{}, internal("could not read the proxy's events; retry")
		}
		st := newState(slog.New(slog.DiscardHandler), 1)
		for _, e := range evs {
			st.apply(e)
		}
		if x := st.proxies[id]; x != nil {
			return *x, nil
		}
	}
	return Proxy{}, notFound("id", "unknown proxy", id)
}
