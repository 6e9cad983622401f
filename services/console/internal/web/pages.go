package web

import (
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/console/internal/fleetview"
	"proxyfleet/services/console/internal/traffic"
)

// kv is one key and value of a list the templates show.
type kv struct {
	Key, Value string
}

type fleetPool struct {
	fleetview.PoolSummary
	Traffic traffic.Rate
	History template.HTML
}

type fleetBody struct {
	Pools       []fleetPool
	HistorySpan string
}

func (s *Server) fleetData(*http.Request) (string, any, error) {
	return "Fleet", s.fleet(), nil
}

func (s *Server) fleet() fleetBody {
	now := time.Now()
	rates := s.cfg.Traffic.Pools()
	pools := s.cfg.Store.Pools(now)
	b := fleetBody{Pools: make([]fleetPool, len(pools)), HistorySpan: s.historySpan()}
	for i, p := range pools {
		r := rates[p.Name]
		b.Pools[i] = fleetPool{PoolSummary: p, Traffic: r, History: historySVG(p.Name, p.History, 160, 36)}
	}
	return b
}

func (s *Server) historySpan() string {
	return (time.Duration(fleetview.HistoryLen) * s.cfg.HistoryEvery).String()
}

// proxyRow is one proxy of a pool page, ready to print.
type proxyRow struct {
	ID, State, Reason, Age, Where, Labels, Address, Egress, Probe, Replaced string
	Gateway                                                                 traffic.Counts
	// Cooling counts the sites the gateways keep off the proxy.
	Cooling int
}

type poolBody struct {
	Name     string
	Known    bool
	Summary  fleetview.PoolSummary
	Traffic  traffic.Rate
	History  template.HTML
	States   []kv
	Spec     []kv
	Page     fleetview.Page
	Rows     []proxyRow
	After    string
	PageSize int
	// First and Last number the rows shown, from 1.
	First, Last int
	MaxSize     int
	// ScaleNote says why the console will not scale this pool, if so.
	ScaleNote string
}

func (s *Server) poolData(r *http.Request) (string, any, error) {
	name := r.PathValue("name")
	if !events.IsIdentifier(name) {
		return "", nil, &pageError{status: http.StatusNotFound, title: "No such pool", text: "A pool name is " + events.IdentifierRule + "."}
	}
	// A pool the views do not hold (yet) has its page too, live: a pool
	// just applied appears on it as soon as health projects it.
	return "Pool " + name, s.pool(name, r.URL.Query().Get("after")), nil
}

func (s *Server) pool(name, after string) poolBody {
	now := time.Now()
	sum, ok := s.cfg.Store.Pool(name, now)
	b := poolBody{Name: name, Known: ok, Summary: sum, After: after, PageSize: s.cfg.PageSize, MaxSize: events.MaxPoolSize}
	if !ok {
		return b
	}
	b.Traffic = s.cfg.Traffic.Pools()[name]
	b.History = historySVG(name, sum.History, 480, 80)
	for _, st := range slices.Sorted(maps.Keys(sum.Counts.States)) {
		b.States = append(b.States, kv{st, strconv.Itoa(sum.Counts.States[st])})
	}
	if sum.Pool != nil {
		b.Spec = specLines(sum.Pool)
		b.ScaleNote = scaleNote(sum.Pool)
	}
	b.Page = s.cfg.Store.Proxies(name, after, s.cfg.PageSize)
	if len(b.Page.Rows) > 0 {
		b.First, b.Last = b.Page.Offset+1, b.Page.Offset+len(b.Page.Rows)
	}
	gw := s.cfg.Traffic.Proxies(name)
	b.Rows = make([]proxyRow, len(b.Page.Rows))
	for i, row := range b.Page.Rows {
		b.Rows[i] = makeRow(row, gw[row.Proxy.ID], now)
	}
	return b
}

func makeRow(row fleetview.ProxyRow, gw traffic.Counts, now time.Time) proxyRow {
	p := row.Proxy
	out := proxyRow{ID: p.ID, State: p.State, Reason: p.Reason, Age: since(p.CreatedAt, now), Address: p.Address, Gateway: gw, Cooling: row.Cooling}
	if p.Entry != "" {
		out.Where = p.Entry + "/" + p.Target
	}
	if len(p.Labels) > 0 {
		parts := make([]string, 0, len(p.Labels))
		for _, k := range slices.Sorted(maps.Keys(p.Labels)) {
			parts = append(parts, k+"="+p.Labels[k])
		}
		out.Labels = strings.Join(parts, ", ")
	}
	out.Egress = p.EgressIP
	if row.HasProbe {
		pr := row.Probe
		if out.Egress == "" {
			out.Egress = pr.EgressIP
		}
		if pr.OK {
			out.Probe = fmt.Sprintf("ok in %d ms, %s ago", pr.LatencyMS, since(pr.CheckedAt, now))
		} else {
			out.Probe = fmt.Sprintf("failed (%d in a row) %s ago: %s", pr.Streak, since(pr.CheckedAt, now), pr.LastError)
		}
	} else if p.LatencyMS > 0 {
		out.Probe = fmt.Sprintf("ready in %d ms", p.LatencyMS)
	} else {
		out.Probe = "not probed yet"
	}
	switch {
	case p.ReplacedBy != "":
		out.Replaced = "by " + p.ReplacedBy + ": " + p.ReplaceReason
	case p.Replaces != "":
		out.Replaced = "replaces " + p.Replaces
	}
	out.Reason, out.Probe, out.Replaced = telemetry.RedactURL(out.Reason), telemetry.RedactURL(out.Probe), telemetry.RedactURL(out.Replaced)
	return out
}

// scaleNote says why the console does not scale pool p ("": it does).
func scaleNote(p *fleetview.Pool) string {
	switch {
	case p.Provider == events.ProviderExternal:
		return "An external pool's size is its list of proxies: change the list and apply it."
	case p.HasSecrets || p.Spec.Auth != nil:
		return "This pool has a password, user-data or credentials, which the console never holds: scale it by applying its whole spec through the API."
	case p.Spec.Autoscale != nil:
		return "This pool autoscales between its min and max, and a re-apply keeps the size autoscaling reached: change its autoscale bounds through the API."
	}
	return ""
}

// specLines are the public parts of a pool's spec, as lines.
func specLines(p *fleetview.Pool) []kv {
	sp := p.Spec
	out := []kv{{"provider", sp.Provider}, {"size", strconv.Itoa(sp.Size)}}
	add := func(k, v string) {
		if v != "" {
			out = append(out, kv{k, v})
		}
	}
	add("targets", strings.Join(sp.Targets, ", "))
	add("image", sp.Image)
	add("profile", sp.Profile)
	if sp.Port != 0 {
		add("port", strconv.Itoa(sp.Port))
	}
	if sp.Auth != nil {
		add("auth", "user "+sp.Auth.Username+" (password kept secret)")
	}
	if sp.MaxAge > 0 {
		add("maxAge", time.Duration(sp.MaxAge).String())
	}
	if sp.UnhealthyAfter > 0 {
		add("unhealthyAfter", time.Duration(sp.UnhealthyAfter).String())
	}
	if sp.DistinctEgress {
		add("distinctEgress", "true")
	}
	if a := sp.Autoscale; a != nil {
		add("autoscale", fmt.Sprintf("min %d, max %d, one proxy per %d connections, down after %s", a.Min, a.Max, a.TargetConnections, a.ScaleDownAfterOrDefault()))
	}
	if e := sp.Egress; e != nil {
		ports := make([]string, len(e.AllowPorts))
		for i, n := range e.AllowPorts {
			ports[i] = strconv.Itoa(n)
		}
		add("egress", strings.TrimSpace(strings.Join(e.AllowCIDRs, ", ")+" ports "+strings.Join(ports, ", ")))
	}
	if pl := sp.Placement; pl != nil {
		add("placement", compactJSON(pl))
	}
	if g := sp.Gateway; g != nil {
		add("gateway", compactJSON(g))
	}
	if ext := sp.External; ext != nil {
		for i, px := range ext.Proxies {
			add(fmt.Sprintf("external[%d]", i), fleetview.StripUserinfo(px.URL))
		}
		add("external.file", ext.File)
	}
	return out
}

type targetRow struct {
	Key, Name, Type, Heartbeat, Version, Capacity, Images, Labels string
	Live, ChecksOK                                                bool
	Check                                                         *fleetview.TargetCheck
}

type targetsBody struct {
	Targets []targetRow
	Health  []kv
}

func (s *Server) targetsData(*http.Request) (string, any, error) { return "Targets", s.targets(), nil }

func (s *Server) targets() targetsBody {
	now := time.Now()
	ts, health := s.cfg.Store.Targets()
	b := targetsBody{Targets: make([]targetRow, len(ts))}
	for i, t := range ts {
		row := targetRow{Key: t.Key, Name: t.Entry + "/" + t.TargetID, Check: t.Check, ChecksOK: t.Check != nil && t.Check.OK}
		row.Capacity = strconv.Itoa(t.Proxies) + " placed"
		if a := t.Agent; a != nil {
			row.Live = t.Live
			row.Type = a.Type
			row.Version = a.Version
			row.Heartbeat = since(a.At, now) + " ago, up " + since(a.StartedAt, now)
			if !t.Live {
				row.Heartbeat = "none for " + since(a.At, now)
			}
			if a.Capacity > 0 {
				row.Capacity += fmt.Sprintf(" of %d", a.Capacity)
			} else {
				row.Capacity += ", no limit"
			}
			row.Capacity += fmt.Sprintf(" (%d instances)", a.Instances)
			imgs := strings.Join(a.Images, ", ")
			if len(a.Profiles) > 0 {
				imgs += "; profiles " + strings.Join(a.Profiles, ", ")
			}
			row.Images = imgs
			parts := make([]string, 0, len(a.Labels))
			for _, k := range slices.Sorted(maps.Keys(a.Labels)) {
				parts = append(parts, k+"="+a.Labels[k])
			}
			row.Labels = strings.Join(parts, ", ")
		}
		b.Targets[i] = row
	}
	for _, id := range slices.Sorted(maps.Keys(health)) {
		b.Health = append(b.Health, kv{id, "alive, seen " + since(health[id], now) + " ago"})
	}
	return b
}

type eventsBody struct {
	Pool, Proxy string
	Entries     []eventRow
}

type eventRow struct {
	Time                           time.Time
	Pool, Proxy, Replacement, Type string
	Text                           string
}

// tailShown is how many entries the events page shows.
const tailShown = 200

func (s *Server) eventsData(r *http.Request) (string, any, error) {
	q := r.URL.Query()
	return "Events", s.eventsOf(q.Get("pool"), q.Get("proxy")), nil
}

func (s *Server) eventsOf(pool, proxy string) eventsBody {
	b := eventsBody{Pool: pool, Proxy: proxy}
	for _, e := range s.cfg.Tail.Last(tailShown, pool, proxy) {
		b.Entries = append(b.Entries, eventRow{Time: e.Time, Pool: e.Pool, Proxy: e.Proxy, Replacement: e.Replacement, Type: e.Type, Text: e.Text})
	}
	return b
}

type gwPool struct {
	Name        string
	RPS         float64
	Connections int
	Rate        traffic.Rate
}

type gatewayBody struct {
	Stream    bool
	Pools     []gwPool
	Failing   []traffic.SiteRate
	Sites     []traffic.SiteRate
	Window    string
	MaxSites  int
	Cooldowns []fleetview.Cooldown
	// MoreCooldowns counts those not shown.
	MoreCooldowns int
}

// cooldownsShown bounds the cooldowns the gateway page lists.
const cooldownsShown = 50

// sitesShown bounds the sites the gateway page lists.
const sitesShown = 100

func (s *Server) gatewayData(*http.Request) (string, any, error) { return "Gateway", s.gateway(), nil }

func (s *Server) gateway() gatewayBody {
	now := time.Now()
	stream, _ := s.cfg.Traffic.HasLog()
	b := gatewayBody{Stream: stream, Window: traffic.Window.String(), MaxSites: sitesShown}
	rates := s.cfg.Traffic.Pools()
	seen := map[string]bool{}
	for _, p := range s.cfg.Store.Pools(now) {
		r := rates[p.Name]
		seen[p.Name] = true
		b.Pools = append(b.Pools, gwPool{Name: p.Name, RPS: p.RequestsPerSecond, Connections: p.Connections, Rate: r})
	}
	for name, r := range rates {
		if !seen[name] {
			b.Pools = append(b.Pools, gwPool{Name: name, Rate: r})
		}
	}
	sort.Slice(b.Pools, func(i, j int) bool { return b.Pools[i].Name < b.Pools[j].Name })
	b.Failing = s.cfg.Traffic.TopFailing(20)
	sites := s.cfg.Traffic.Sites(traffic.RateSpan)
	sort.SliceStable(sites, func(i, j int) bool { return sites[i].Requests > sites[j].Requests })
	if len(sites) > sitesShown {
		sites = sites[:sitesShown]
	}
	b.Sites = sites
	b.Cooldowns = s.cfg.Store.Cooldowns("", now)
	if len(b.Cooldowns) > cooldownsShown {
		b.MoreCooldowns = len(b.Cooldowns) - cooldownsShown
		b.Cooldowns = b.Cooldowns[:cooldownsShown]
	}
	return b
}
