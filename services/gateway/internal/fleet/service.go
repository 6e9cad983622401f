package fleet

import (
	"slices"
	"time"

	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/gateway/internal/forward"
)

// ServiceName is the gateway's micro service: `nats micro info
// fleet-gateway` lists the gateways; each answers on its own subjects
// ([events.GatewaySubject]).
const ServiceName = "fleet-gateway"

// Info is the reply of the info endpoint.
type Info struct {
	Name    string `json:"name"`
	Version string `json:"version"`
	Listen  string `json:"listen"`
	// Key is the public curve key the planner seals passwords to.
	Key   string              `json:"key"`
	Pools map[string]PoolInfo `json:"pools"`
}

// PoolInfo is what info says of one pool.
type PoolInfo struct {
	Ready    []string `json:"ready"`
	Strategy string   `json:"strategy"`
	Sessions int      `json:"sessions"`
	BanRules []string `json:"banRules,omitempty"`
	// Cooled lists, per site, the proxies kept off it now (cooldown ban
	// rules, every gateway's).
	Cooled map[string][]string `json:"cooled,omitempty"`
	// PerSite and Session are the pool's politeness and session rotation
	// (absent when not set).
	PerSite *events.PerSite         `json:"perSite,omitempty"`
	Session *events.SessionRotation `json:"session,omitempty"`
	// Credentials is "none", "ok" or why the password does not open.
	Credentials string `json:"credentials"`
	// Labels are the labels of the ready proxies that carry any, by
	// proxy.
	Labels map[string]map[string]string `json:"labels,omitempty"`
	// Fallback and TierMemory are the pool's tiers (absent when it has
	// none); Tiers the sites that start at a fallback pool now, on this
	// gateway.
	Fallback   []string            `json:"fallback,omitempty"`
	TierMemory string              `json:"tierMemory,omitempty"`
	Tiers      []forward.TierEntry `json:"tiers,omitempty"`
}

// Stats is the reply of the stats endpoint: per pool, the requests,
// errors, bans and bytes carried since the gateway started, the open
// connections, and the same per proxy.
type Stats struct {
	Name  string                          `json:"name"`
	Pools map[string]forward.PoolSnapshot `json:"pools"`
}

func (f *Fleet) info() Info {
	out := Info{Name: f.cfg.Name, Version: f.cfg.Version, Listen: f.cfg.Listen, Key: seal.Public(f.cfg.Key), Pools: map[string]PoolInfo{}}
	cooled := map[string]map[string][]string{}
	now := time.Now()
	for _, e := range f.cooldowns.Entries() {
		if !now.Before(e.Until) {
			continue
		}
		if cooled[e.Pool] == nil {
			cooled[e.Pool] = map[string][]string{}
		}
		cooled[e.Pool][e.Site] = append(cooled[e.Pool][e.Site], e.Proxy)
	}
	var tiers []forward.TierEntry
	if f.srv != nil {
		tiers = f.srv.Tiers()
	}
	for _, name := range f.poolNames() {
		spec := f.table.Spec(name)
		pi := PoolInfo{Ready: []string{}, Strategy: spec.StrategyOrDefault(), Sessions: f.table.Sessions(name), Credentials: "none", Cooled: cooled[name]}
		if spec != nil {
			pi.PerSite, pi.Session = spec.PerSite, spec.Session
			if len(spec.Fallback) > 0 {
				pi.Fallback, pi.TierMemory = spec.Fallback, spec.TierMemoryOrDefault().String()
			}
		}
		for _, ids := range pi.Cooled {
			slices.Sort(ids)
		}
		for _, x := range f.table.Ready(name) {
			pi.Ready = append(pi.Ready, x.ID)
			if len(x.Labels) > 0 {
				if pi.Labels == nil {
					pi.Labels = map[string]map[string]string{}
				}
				pi.Labels[x.ID] = x.Labels
			}
		}
		for _, e := range tiers {
			if e.Pool == name {
				pi.Tiers = append(pi.Tiers, e)
			}
		}
		for _, r := range f.Rules(name) {
			pi.BanRules = append(pi.BanRules, r.Name)
		}
		f.mu.Lock()
		p := f.pools[name]
		c, ok := f.creds[name]
		f.mu.Unlock()
		switch {
		case p == nil || p.user == "":
		case !ok:
			pi.Credentials = "not sealed to this gateway's key yet"
		case c.err != nil:
			pi.Credentials = c.err.Error()
		default:
			pi.Credentials = "ok"
		}
		out.Pools[name] = pi
	}
	return out
}

// serveCA answers the gateway CA's certificate, PEM, or a 503 saying why
// it is not known.
func (f *Fleet) serveCA(req micro.Request) {
	pem, err := f.CAPEM()
	if err != nil {
		_ = req.Error("503", err.Error(), nil)
		return
	}
	_ = req.Respond(pem)
}

func (f *Fleet) stats() Stats {
	return Stats{Name: f.cfg.Name, Pools: f.srv.Stats().Snapshot()}
}

func (f *Fleet) startService() (micro.Service, error) {
	svc, err := micro.AddService(f.conn.NC, micro.Config{
		Name:        ServiceName,
		Version:     f.cfg.Version,
		Description: "proxyfleet crawler gateway " + f.cfg.Name + " on " + f.cfg.Listen,
		Metadata:    map[string]string{"name": f.cfg.Name, "listen": f.cfg.Listen},
	})
	if err != nil {
		return nil, err
	}
	g := svc.AddGroup(events.GatewayGroup(f.cfg.Name))
	if err := g.AddEndpoint(events.GatewayInfo, micro.HandlerFunc(func(req micro.Request) { _ = req.RespondJSON(f.info()) })); err != nil {
		return nil, err
	}
	if err := g.AddEndpoint(events.GatewayStats, micro.HandlerFunc(func(req micro.Request) { _ = req.RespondJSON(f.stats()) })); err != nil {
		return nil, err
	}
	if err := g.AddEndpoint(events.GatewayCA, micro.HandlerFunc(f.serveCA)); err != nil {
		return nil, err
	}
	return svc, nil
}
