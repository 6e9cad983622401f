package planner

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
	"proxyfleet/services/planner/internal/apiserver"
)

// backend is the planner as its operator API sees it
// ([apiserver.Backend]): reads of the projection (this file) and the
// operator's decisions, taken by the one writer (intents.go for pool.apply
// and pool.delete, operator.go for the leader's decisions).
type backend struct{ *Planner }

var _ apiserver.Backend = backend{}

// poolView returns the view of pool name (an empty one naming it when the
// projection holds none).
func (p *Planner) poolView(name string) api.PoolView {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl := p.st.pools[name]; pl != nil {
		return pl.view()
	}
	return api.PoolView{Name: name}
}

// Pool implements [apiserver.State].
func (b backend) Pool(name string) (api.PoolView, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	pl := b.st.pools[name]
	if pl == nil || pl.Revision == 0 {
		return api.PoolView{}, false
	}
	return pl.view(), true
}

// Pools implements [apiserver.State]: applied pools, and deleted ones
// until their last proxy is gone.
func (b backend) Pools(after string, n int) []api.PoolView {
	b.mu.Lock()
	defer b.mu.Unlock()
	visible := func(yield func(*Pool) bool) {
		for _, pl := range b.st.pools {
			if pl.Revision == 0 || (pl.Deleted && len(pl.members) == 0) {
				continue
			}
			if !yield(pl) {
				return
			}
		}
	}
	pools := page.FirstAfter(visible, func(pl *Pool) string { return pl.Name }, after, n)
	views := make([]api.PoolView, len(pools))
	for i, pl := range pools {
		views[i] = pl.view()
	}
	return views
}

// Proxies implements [apiserver.State].
func (b backend) Proxies(pool, after string, n int) []events.ProxyView {
	b.mu.Lock()
	defer b.mu.Unlock()
	pools := b.st.pools
	if pool != "" {
		pools = map[string]*Pool{pool: b.st.pools[pool]}
	}
	live := func(yield func(*Proxy) bool) {
		for _, pl := range pools {
			if pl == nil {
				continue
			}
			for _, x := range pl.members {
				if !yield(x) {
					return
				}
			}
		}
	}
	proxies := page.FirstAfter(live, func(x *Proxy) string { return x.ID }, after, n)
	views := make([]events.ProxyView, len(proxies))
	for i, x := range proxies {
		views[i] = x.ProxyView
	}
	return views
}

// Proxy implements [apiserver.State].
func (b backend) Proxy(ctx context.Context, id string) (events.ProxyView, *api.APIError) {
	x, aerr := b.lookupProxy(ctx, id)
	return x.ProxyView, aerr
}

// lookupProxy returns a copy of the proxy with id, or a 422. A proxy that
// finished long ago is no longer in memory: it is folded from the log.
func (p *Planner) lookupProxy(ctx context.Context, id string) (Proxy, *api.APIError) {
	p.mu.Lock()
	var cp Proxy
	x := p.st.proxies[id]
	ok := x != nil
	if ok {
		cp = *x // copied under the lock: the fold writes it
	}
	p.mu.Unlock()
	if ok {
		return cp, nil
	}
	return p.recallProxy(ctx, id)
}

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
		return Proxy{}, api.Internal("could not read the proxy's events; retry")
	}
	if last != nil {
		evs, err := p.store.Load(ctx, events.AggregateProxy, id)
		if err != nil {
			p.log.WarnContext(ctx, "read a proxy's events", "proxy", id, "err", err)
			return Proxy{}, api.Internal("could not read the proxy's events; retry")
		}
		st := newState(slog.New(slog.DiscardHandler), 1)
		for _, e := range evs {
			st.apply(e)
		}
		if x := st.proxies[id]; x != nil {
			return *x, nil
		}
	}
	return Proxy{}, api.NotFound("id", "unknown proxy", id)
}

// Targets implements [apiserver.State]: the targets of entry come from
// events and from every agent that heartbeated since start.
func (b backend) Targets(ctx context.Context, entry string, want []string) (map[string]bool, bool) {
	b.mu.Lock()
	targets, known := b.knownTargetsLocked(entry)
	b.mu.Unlock()
	stale := !known
	for _, t := range want {
		stale = stale || !targets[t]
	}
	if stale {
		b.refreshAgents(ctx, entry)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.knownTargetsLocked(entry)
}

// LabelKeys implements [apiserver.State]: the label keys of entry's live
// agents' last heartbeats.
func (b backend) LabelKeys(ctx context.Context, entry string) (map[string]bool, bool) {
	keys, live := b.labelKeys(entry)
	if !live {
		b.refreshAgents(ctx, entry)
		keys, live = b.labelKeys(entry)
	}
	return keys, live
}

// labelKeys is [backend.LabelKeys] without the fresh read.
func (b backend) labelKeys(entry string) (map[string]bool, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	keys := map[string]bool{}
	live := false
	for _, a := range b.liveAgentsLocked(b.now()) {
		if a.Entry != entry {
			continue
		}
		live = true
		for k := range a.Labels {
			keys[k] = true
		}
	}
	return keys, live
}

// Inventory implements [apiserver.State].
func (b backend) Inventory(ctx context.Context, entry, target string) ([]agent.Instance, error) {
	return b.requestInventory(ctx, agentSeen{Entry: entry, Target: target})
}

// requestInventory asks one agent for its marked instances, page by page;
// InventoryTimeout bounds the whole walk.
func (p *Planner) requestInventory(ctx context.Context, a agentSeen) ([]agent.Instance, error) {
	rctx, cancel := context.WithTimeout(ctx, p.cfg.InventoryTimeout)
	defer cancel()
	var all []agent.Instance
	after := ""
	subject := events.AgentSubject(a.Entry, a.Target, events.AgentInventory)
	for {
		body, err := json.Marshal(page.Request{Limit: page.MaxLimit, After: after})
		if err != nil {
			return nil, err
		}
		msg, err := p.conn.NC.RequestWithContext(rctx, subject, body)
		if err != nil {
			return nil, err
		}
		if aerr := api.ReplyError(msg); aerr != nil {
			return nil, fmt.Errorf("agent answered error %s: %s", aerr.Status, aerr.Message)
		}
		var pg agent.Inventory
		if err := json.Unmarshal(msg.Data, &pg); err != nil {
			return nil, fmt.Errorf("unreadable inventory: %w", err)
		}
		all = append(all, pg.Instances...)
		if pg.Next == "" {
			return all, nil
		}
		if pg.Next <= after {
			return nil, fmt.Errorf("inventory page after %q names next %q, which does not move forward", after, pg.Next)
		}
		after = pg.Next
	}
}
