package events

import (
	"encoding/base64"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strings"
	"time"
)

// The gateway (services/gateway) is the crawler's one endpoint in front of
// the fleet. These are the parts of its contract other services share: the
// pool fields that steer it ([GatewaySpec]) and the planner's autoscaling
// ([Autoscale], [PoolScaledData]), the demand it reports ([GatewayDemand] in the
// fleet-demand bucket) and the suspect reports it sends health
// ([SuspectSubject]).

// Gateway routing strategies ([GatewaySpec.Strategy]).
const (
	StrategyRoundRobin       = "round-robin"
	StrategyLeastConnections = "least-connections"
	StrategyRandom           = "random"
)

// Gateway defaults and limits.
const (
	DefaultSessionTTL     = 10 * time.Minute
	DefaultGatewayRetries = 2
	MaxGatewayRetries     = 10
	MaxBanRules           = 32
	// DefaultBanThreshold and DefaultBanWindow: a rule that matches this
	// many responses of one proxy within the window reports it banned.
	DefaultBanThreshold = 5
	DefaultBanWindow    = time.Minute
	// BanBodyLimit is how much of a plain HTTP response body a ban rule's
	// body pattern sees.
	BanBodyLimit = 64 << 10
	// MaxBanPattern bounds a ban rule's regular expressions (headerMatch,
	// body), in bytes.
	MaxBanPattern = 1024
	// MaxBanStatuses bounds a ban rule's status list.
	MaxBanStatuses = 32
	// MaxHeaderName bounds a ban rule's header name, in bytes.
	MaxHeaderName = 256
	// DefaultScaleDownAfter is how long demand must stay low before an
	// autoscaled pool shrinks.
	DefaultScaleDownAfter = 5 * time.Minute
	// MinScaleDownAfter is the shortest scaleDownAfter a pool may ask for.
	MinScaleDownAfter = 10 * time.Second
	// DefaultQueueTimeout is how long a request waits for a proxy under
	// its per-site limits ([PerSite.QueueTimeout]) when the pool names
	// none; MaxQueueTimeout bounds what a pool may name.
	DefaultQueueTimeout = 5 * time.Second
	MaxQueueTimeout     = time.Minute
	// MaxSiteConcurrency and MaxSiteRate bound [PerSite]'s limits;
	// MinSiteRate is the slowest rate (one request per 100 s).
	MaxSiteConcurrency = 10_000
	MaxSiteRate        = 10_000
	MinSiteRate        = 0.01
	// MaxSessionRequests bounds [SessionRotation.MaxRequests].
	MaxSessionRequests = 1_000_000

	// DefaultBanCooldown is how long a cooldown rule keeps a proxy off
	// the site that banned it; MinBanCooldown and MaxBanCooldown bound a
	// rule's cooldown.
	DefaultBanCooldown = 30 * time.Minute
	MinBanCooldown     = time.Second
	MaxBanCooldown     = 24 * time.Hour
	// DefaultRetireAfterSites and DefaultRetireAfterSitesWindow: a proxy
	// cooled on this many distinct sites within the window is reported
	// banned ([GatewaySpec.RetireAfterSites]); MaxRetireAfterSites and
	// the window's bounds limit what a pool may ask for.
	DefaultRetireAfterSites       = 3
	MaxRetireAfterSites           = 1000
	DefaultRetireAfterSitesWindow = time.Hour
	MinRetireAfterSitesWindow     = time.Minute
	MaxRetireAfterSitesWindow     = 24 * time.Hour
	// MaxFallback bounds [GatewaySpec.Fallback]; DefaultTierMemory is how
	// long a site that needed a fallback pool starts there
	// ([GatewaySpec.TierMemory]), MinTierMemory and MaxTierMemory bound
	// what a pool may ask for.
	MaxFallback       = 4
	DefaultTierMemory = 10 * time.Minute
	MinTierMemory     = time.Second
	MaxTierMemory     = 24 * time.Hour
)

// Ban rule actions ([BanRule.Action]): what a rule's verdict does to the
// proxy. Every matching response is retried on another proxy whatever the
// action, while the pool's retries allow.
const (
	// BanActionRetire reports the proxy banned once Threshold responses
	// matched within Window: the planner retires and replaces it.
	BanActionRetire = "retire"
	// BanActionCooldown keeps the proxy off the site (its registrable
	// domain) that answered Threshold matching responses within Window,
	// for Cooldown; it serves every other site meanwhile.
	BanActionCooldown = "cooldown"
	// BanActionRetry only retries the request on another proxy: no
	// verdict on the proxy.
	BanActionRetry = "retry"
)

// GatewaySpec is how the gateway routes a pool's traffic (pool field
// "gateway"); nil means every default.
type GatewaySpec struct {
	// Strategy picks the proxy of each new connection: round-robin
	// (default), least-connections or random.
	Strategy string `json:"strategy,omitempty"`
	// SessionTTL is how long a session (username "<pool>.session-<id>")
	// stays pinned to its proxy without use (default 10m).
	SessionTTL Duration `json:"sessionTTL,omitempty"`
	// Retries bounds the other proxies a failed request is tried on
	// (default 2; 0 disables failover).
	Retries *int `json:"retries,omitempty"`
	// BanRules recognise a banned proxy by its responses.
	BanRules []BanRule `json:"banRules,omitempty"`
	// RetireAfterSites reports a proxy banned once it was cooled (by a
	// cooldown rule, by any gateway) on this many distinct sites within
	// RetireAfterSitesWindow (default 3; 0 never reports it).
	RetireAfterSites *int `json:"retireAfterSites,omitempty"`
	// RetireAfterSitesWindow is the span RetireAfterSites counts sites
	// over (default 1h, 1m to 24h).
	RetireAfterSitesWindow Duration `json:"retireAfterSitesWindow,omitempty"`
	// Intercept has the gateway terminate its clients' CONNECT tunnels
	// itself, with a certificate of the fleet's gateway CA for the host,
	// and carry each HTTPS request inside as it carries plain HTTP: per
	// request routing, sessions, ban rules (bodies included), retries and
	// stats. Clients must trust the gateway CA. Off by default: tunnels
	// are opaque.
	Intercept bool `json:"intercept,omitempty"`
	// PerSite holds each proxy to limits per site (nil: none).
	PerSite *PerSite `json:"perSite,omitempty"`
	// Session rotates sessions to another proxy (nil: a session stays on
	// its proxy while it is ready).
	Session *SessionRotation `json:"session,omitempty"`
	// Fallback names the pools (tiers) a request goes on to, in order,
	// when no proxy of this pool may serve it: none ready (or none with
	// the labels the client selected), all cooled for the site, all at
	// their per-site limits past the queue timeout, every attempt failed
	// or ended on a ban page. Each fallback pool serves with its own
	// credentials, rules and settings, and its own fallbacks follow it;
	// a client allowed to use this pool may be served by them. At most
	// [MaxFallback] names, not this pool's. A cycle across pools is
	// harmless: the gateway visits no pool twice for one request.
	Fallback []string `json:"fallback,omitempty"`
	// TierMemory is how long a site that needed a fallback pool starts
	// at that pool for this pool's clients (default 10m, 1s to 24h).
	TierMemory Duration `json:"tierMemory,omitempty"`
}

// FallbackPools is the spec's fallback pools (g may be nil).
func (g *GatewaySpec) FallbackPools() []string {
	if g == nil {
		return nil
	}
	return g.Fallback
}

// TierMemoryOrDefault is the spec's tierMemory or [DefaultTierMemory].
func (g *GatewaySpec) TierMemoryOrDefault() time.Duration {
	if g == nil || g.TierMemory <= 0 {
		return DefaultTierMemory
	}
	return time.Duration(g.TierMemory)
}

// PerSite is the politeness of a pool's proxies towards each site (a
// registrable domain): how many requests one proxy carries to one site at
// once and how fast it starts them. A request waits up to QueueTimeout for
// a proxy under both limits, then is answered 429. A CONNECT tunnel counts
// as one request for its whole life. Zero limits are unlimited; at least
// one must be set.
type PerSite struct {
	// Concurrency bounds the requests in flight at once per proxy per
	// site.
	Concurrency int `json:"concurrency,omitempty"`
	// Rate bounds the requests started per second per proxy per site: a
	// token bucket refilled at Rate that holds at most [PerSite.Burst]
	// tokens.
	Rate float64 `json:"rate,omitempty"`
	// QueueTimeout is how long a request waits for a proxy under its
	// limits (default [DefaultQueueTimeout], at most [MaxQueueTimeout]; a
	// negative value is refused, 0 takes the default).
	QueueTimeout Duration `json:"queueTimeout,omitempty"`
}

// Burst is how many requests a proxy may start at once towards one site
// after being idle there: a quarter second's worth of Rate, at least one.
// A small burst keeps the requests spread as the rate says.
func (p *PerSite) Burst() int {
	return max(1, int(math.Ceil(p.Rate/4)))
}

// QueueTimeoutOrDefault is the queue timeout or [DefaultQueueTimeout].
func (p *PerSite) QueueTimeoutOrDefault() time.Duration {
	if p == nil || p.QueueTimeout <= 0 {
		return DefaultQueueTimeout
	}
	return time.Duration(p.QueueTimeout)
}

func (p *PerSite) validate(v *ValidationError, prefix string) {
	if p.Concurrency == 0 && p.Rate == 0 {
		v.Add(prefix, "must set concurrency or rate (or be left out)", "")
	}
	if p.Concurrency < 0 || p.Concurrency > MaxSiteConcurrency {
		v.Add(prefix+".concurrency", fmt.Sprintf("must be between 1 and %d requests at once (0 or absent: unlimited)", MaxSiteConcurrency), fmt.Sprint(p.Concurrency))
	}
	if p.Rate != 0 && !(p.Rate >= MinSiteRate && p.Rate <= MaxSiteRate) {
		v.Add(prefix+".rate", fmt.Sprintf("must be between %g and %d requests per second (0 or absent: unlimited)", MinSiteRate, MaxSiteRate), fmt.Sprint(p.Rate))
	}
	if p.QueueTimeout < 0 || time.Duration(p.QueueTimeout) > MaxQueueTimeout {
		v.Add(prefix+".queueTimeout", "must be between 0 (the default, "+DefaultQueueTimeout.String()+") and "+MaxQueueTimeout.String(), time.Duration(p.QueueTimeout).String())
	}
}

// SessionRotation moves a session to another ready proxy once it has been
// used MaxRequests times, or is MaxAge old, on its current proxy (each
// plain HTTP request and each CONNECT tunnel is one use). Zero values do
// not rotate; at least one must be set.
type SessionRotation struct {
	MaxRequests int      `json:"maxRequests,omitempty"`
	MaxAge      Duration `json:"maxAge,omitempty"`
}

func (s *SessionRotation) validate(v *ValidationError, prefix string) {
	if s.MaxRequests == 0 && s.MaxAge == 0 {
		v.Add(prefix, "must set maxRequests or maxAge (or be left out)", "")
	}
	if s.MaxRequests < 0 || s.MaxRequests > MaxSessionRequests {
		v.Add(prefix+".maxRequests", fmt.Sprintf("must be between 1 and %d (0 or absent: no limit)", MaxSessionRequests), fmt.Sprint(s.MaxRequests))
	}
	if s.MaxAge < 0 {
		v.Add(prefix+".maxAge", "must not be negative", time.Duration(s.MaxAge).String())
	} else if s.MaxAge > 0 && time.Duration(s.MaxAge) < time.Second {
		v.Add(prefix+".maxAge", "must be at least 1s", time.Duration(s.MaxAge).String())
	}
}

// BanRule matches responses that show the proxy's address is banned. A
// response matches when it meets every condition the rule sets (at least
// one): its status is one of Status, its header Header matches
// HeaderMatch, its body (the first [BanBodyLimit] bytes) matches Body.
// A matching response is not delivered while the request may be retried
// on another proxy. Action says what else a match does: retire (default)
// reports the proxy banned (retiring reason "banned: <name>") once Threshold matches of
// one proxy fell within Window, whatever their sites; cooldown keeps the
// proxy off one site for Cooldown once Threshold matches of that proxy on
// that site fell within Window; retry does nothing more.
type BanRule struct {
	Name        string   `json:"name"`
	Status      []int    `json:"status,omitempty"`
	Header      string   `json:"header,omitempty"`
	HeaderMatch string   `json:"headerMatch,omitempty"`
	Body        string   `json:"body,omitempty"`
	Action      string   `json:"action,omitempty"`
	Threshold   int      `json:"threshold,omitempty"`
	Window      Duration `json:"window,omitempty"`
	// Cooldown is how long a cooldown rule keeps a proxy off the site
	// (default 30m, 1s to 24h); only a cooldown rule sets it.
	Cooldown Duration `json:"cooldown,omitempty"`
}

// ActionOrDefault is the rule's action or [BanActionRetire].
func (r BanRule) ActionOrDefault() string {
	if r.Action == "" {
		return BanActionRetire
	}
	return r.Action
}

// ThresholdOrDefault is the rule's threshold, or its action's default:
// [DefaultBanThreshold] to retire a proxy, 1 to cool it (one ban page of
// a site keeps the proxy off that site only, which costs little).
func (r BanRule) ThresholdOrDefault() int {
	switch {
	case r.Threshold > 0:
		return r.Threshold
	case r.ActionOrDefault() == BanActionCooldown:
		return 1
	}
	return DefaultBanThreshold
}

// CooldownOrDefault is the rule's cooldown or [DefaultBanCooldown].
func (r BanRule) CooldownOrDefault() time.Duration {
	if r.Cooldown <= 0 {
		return DefaultBanCooldown
	}
	return time.Duration(r.Cooldown)
}

// WindowOrDefault is the rule's window or [DefaultBanWindow].
func (r BanRule) WindowOrDefault() time.Duration {
	if r.Window <= 0 {
		return DefaultBanWindow
	}
	return time.Duration(r.Window)
}

// RetireAfterSitesOrDefault is the spec's retireAfterSites or
// [DefaultRetireAfterSites] (0: never).
func (g *GatewaySpec) RetireAfterSitesOrDefault() int {
	if g == nil || g.RetireAfterSites == nil {
		return DefaultRetireAfterSites
	}
	return *g.RetireAfterSites
}

// RetireAfterSitesWindowOrDefault is the spec's retireAfterSitesWindow or
// [DefaultRetireAfterSitesWindow].
func (g *GatewaySpec) RetireAfterSitesWindowOrDefault() time.Duration {
	if g == nil || g.RetireAfterSitesWindow <= 0 {
		return DefaultRetireAfterSitesWindow
	}
	return time.Duration(g.RetireAfterSitesWindow)
}

// StrategyOrDefault is the spec's strategy or round-robin (g may be nil).
func (g *GatewaySpec) StrategyOrDefault() string {
	if g == nil || g.Strategy == "" {
		return StrategyRoundRobin
	}
	return g.Strategy
}

// SessionTTLOrDefault is the spec's session TTL or [DefaultSessionTTL].
func (g *GatewaySpec) SessionTTLOrDefault() time.Duration {
	if g == nil || g.SessionTTL <= 0 {
		return DefaultSessionTTL
	}
	return time.Duration(g.SessionTTL)
}

// RetriesOrDefault is the spec's retries or [DefaultGatewayRetries].
func (g *GatewaySpec) RetriesOrDefault() int {
	if g == nil || g.Retries == nil {
		return DefaultGatewayRetries
	}
	return *g.Retries
}

// validate checks g, the gateway spec of pool; fields are named under
// prefix.
func (g *GatewaySpec) validate(v *ValidationError, prefix, pool string) {
	switch g.Strategy {
	case "", StrategyRoundRobin, StrategyLeastConnections, StrategyRandom:
	default:
		v.Add(prefix+".strategy", "must be round-robin, least-connections or random", g.Strategy)
	}
	if g.SessionTTL < 0 {
		v.Add(prefix+".sessionTTL", "must not be negative", time.Duration(g.SessionTTL).String())
	} else if g.SessionTTL > 0 && time.Duration(g.SessionTTL) < time.Second {
		v.Add(prefix+".sessionTTL", "must be at least 1s", time.Duration(g.SessionTTL).String())
	}
	if g.Retries != nil && (*g.Retries < 0 || *g.Retries > MaxGatewayRetries) {
		v.Add(prefix+".retries", fmt.Sprintf("must be between 0 and %d", MaxGatewayRetries), fmt.Sprint(*g.Retries))
	}
	if g.RetireAfterSites != nil && (*g.RetireAfterSites < 0 || *g.RetireAfterSites > MaxRetireAfterSites) {
		v.Add(prefix+".retireAfterSites", fmt.Sprintf("must be between 0 (never) and %d", MaxRetireAfterSites), fmt.Sprint(*g.RetireAfterSites))
	}
	checkSpan(v, prefix+".retireAfterSitesWindow", time.Duration(g.RetireAfterSitesWindow), MinRetireAfterSitesWindow, MaxRetireAfterSitesWindow)
	if len(g.Fallback) > MaxFallback {
		v.Add(prefix+".fallback", fmt.Sprintf("may name at most %d pools", MaxFallback), fmt.Sprint(len(g.Fallback)))
	}
	fallbacks := map[string]bool{}
	for i, name := range g.Fallback {
		f := fmt.Sprintf("%s.fallback[%d]", prefix, i)
		v.AddField(CheckIdentifier(f, name))
		switch {
		case name == pool:
			v.Add(f, "names this pool itself; name other pools to fall back to", name)
		case fallbacks[name]:
			v.Add(f, "is named twice", name)
		}
		fallbacks[name] = true
	}
	checkSpan(v, prefix+".tierMemory", time.Duration(g.TierMemory), MinTierMemory, MaxTierMemory)
	if g.PerSite != nil {
		g.PerSite.validate(v, prefix+".perSite")
	}
	if g.Session != nil {
		g.Session.validate(v, prefix+".session")
	}
	if len(g.BanRules) > MaxBanRules {
		v.Add(prefix+".banRules", fmt.Sprintf("may hold at most %d rules", MaxBanRules), fmt.Sprint(len(g.BanRules)))
	}
	names := map[string]bool{}
	for i, r := range g.BanRules {
		f := fmt.Sprintf("%s.banRules[%d]", prefix, i)
		v.AddField(CheckIdentifier(f+".name", r.Name))
		if names[r.Name] {
			v.Add(f+".name", "is used by another rule", r.Name)
		}
		names[r.Name] = true
		if len(r.Status) == 0 && r.Header == "" && r.Body == "" {
			v.Add(f, "must set status, header or body", "")
		}
		if len(r.Status) > MaxBanStatuses {
			v.Add(f+".status", fmt.Sprintf("may hold at most %d statuses", MaxBanStatuses), fmt.Sprint(len(r.Status)))
		}
		for j, s := range r.Status {
			if s < 100 || s > 599 {
				v.Add(fmt.Sprintf("%s.status[%d]", f, j), "must be an HTTP status (100-599)", fmt.Sprint(s))
			}
		}
		if r.Header != "" && !isToken(r.Header) {
			v.Add(f+".header", "must be a header name (an HTTP token: letters, digits and !#$%&'*+-.^_`|~)", r.Header)
		} else if len(r.Header) > MaxHeaderName {
			v.Add(f+".header", fmt.Sprintf("may be at most %d bytes long", MaxHeaderName), fmt.Sprintf("%d bytes", len(r.Header)))
		}
		if (r.Header == "") != (r.HeaderMatch == "") {
			v.Add(f+".headerMatch", "header and headerMatch go together", r.HeaderMatch)
		}
		checkPattern(v, f+".headerMatch", r.HeaderMatch)
		checkPattern(v, f+".body", r.Body)
		if r.Threshold < 0 {
			v.Add(f+".threshold", "must be 1 or more", fmt.Sprint(r.Threshold))
		}
		if r.Window < 0 {
			v.Add(f+".window", "must not be negative", time.Duration(r.Window).String())
		} else if r.Window > 0 && time.Duration(r.Window) < time.Second {
			v.Add(f+".window", "must be at least 1s", time.Duration(r.Window).String())
		}
		switch r.Action {
		case "", BanActionRetire, BanActionCooldown:
		case BanActionRetry:
			if r.Threshold != 0 || r.Window != 0 {
				v.Add(f+".action", "a retry rule gives no verdict: leave threshold and window out, or use retire or cooldown", r.Action)
			}
		default:
			v.Add(f+".action", "must be retire, cooldown or retry", r.Action)
		}
		if r.Cooldown != 0 && r.ActionOrDefault() != BanActionCooldown {
			v.Add(f+".cooldown", `only a rule with action "cooldown" sets it`, time.Duration(r.Cooldown).String())
		} else {
			checkSpan(v, f+".cooldown", time.Duration(r.Cooldown), MinBanCooldown, MaxBanCooldown)
		}
	}
}

// checkSpan checks an optional duration (0: the default) against its
// bounds.
func checkSpan(v *ValidationError, field string, d, least, most time.Duration) {
	switch {
	case d == 0:
	case d < least || d > most:
		v.Add(field, "must be between "+least.String()+" and "+most.String(), d.String())
	}
}

// checkPattern checks a ban rule's regular expression ("" for none): at
// most [MaxBanPattern] bytes, and one that compiles.
func checkPattern(v *ValidationError, field, pattern string) {
	switch {
	case pattern == "":
	case len(pattern) > MaxBanPattern:
		v.Add(field, fmt.Sprintf("may be at most %d bytes long", MaxBanPattern), fmt.Sprintf("%d bytes", len(pattern)))
	default:
		if _, err := regexp.Compile(pattern); err != nil {
			v.Add(field, "must be a regular expression: "+err.Error(), pattern)
		}
	}
}

// isToken reports whether s is an HTTP token (RFC 9110, 5.6.2), what a
// header name is.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// Clone returns a deep copy of g (nil for nil).
func (g *GatewaySpec) Clone() *GatewaySpec {
	if g == nil {
		return nil
	}
	out := *g
	if g.Retries != nil {
		n := *g.Retries
		out.Retries = &n
	}
	if g.RetireAfterSites != nil {
		n := *g.RetireAfterSites
		out.RetireAfterSites = &n
	}
	out.BanRules = make([]BanRule, len(g.BanRules))
	for i, r := range g.BanRules {
		r.Status = append([]int(nil), r.Status...)
		out.BanRules[i] = r
	}
	if g.BanRules == nil {
		out.BanRules = nil
	}
	if g.PerSite != nil {
		p := *g.PerSite
		out.PerSite = &p
	}
	if g.Session != nil {
		r := *g.Session
		out.Session = &r
	}
	out.Fallback = slices.Clone(g.Fallback)
	return &out
}

// Autoscale is how the planner sizes a pool by the demand gateways
// report (pool field "autoscale"): between Min and Max proxies, one per
// TargetConnections open connections, growing at once and shrinking only
// after demand stayed low for ScaleDownAfter. Each change of size is a
// pool.scaled event ([PoolScaledData]) with its reason.
type Autoscale struct {
	Min               int      `json:"min"`
	Max               int      `json:"max"`
	TargetConnections int      `json:"targetConnections"`
	ScaleDownAfter    Duration `json:"scaleDownAfter,omitempty"`
}

// ScaleDownAfterOrDefault is the autoscale's scaleDownAfter or
// [DefaultScaleDownAfter].
func (a Autoscale) ScaleDownAfterOrDefault() time.Duration {
	if a.ScaleDownAfter <= 0 {
		return DefaultScaleDownAfter
	}
	return time.Duration(a.ScaleDownAfter)
}

// Clamp returns n moved into [Min, Max].
func (a Autoscale) Clamp(n int) int {
	return max(a.Min, min(n, a.Max))
}

// Want is the number of proxies connections call for: one per
// TargetConnections (rounded up), clamped into [Min, Max].
func (a Autoscale) Want(connections int) int {
	per := max(a.TargetConnections, 1)
	return a.Clamp((max(connections, 0) + per - 1) / per)
}

// Clone returns a copy of a (nil for nil).
func (a *Autoscale) Clone() *Autoscale {
	if a == nil {
		return nil
	}
	out := *a
	return &out
}

// Validate checks a; fields are named under prefix ("autoscale").
func (a *Autoscale) Validate(v *ValidationError, prefix string) {
	if a.Min < 1 {
		v.Add(prefix+".min", "must be 1 or more", fmt.Sprint(a.Min))
	}
	if a.Max < a.Min {
		v.Add(prefix+".max", "must be at least min", fmt.Sprint(a.Max))
	} else if a.Max > MaxPoolSize {
		v.Add(prefix+".max", fmt.Sprintf("must be at most %d", MaxPoolSize), fmt.Sprint(a.Max))
	}
	if a.TargetConnections < 1 {
		v.Add(prefix+".targetConnections", "must be 1 or more", fmt.Sprint(a.TargetConnections))
	}
	if a.ScaleDownAfter < 0 {
		v.Add(prefix+".scaleDownAfter", "must not be negative", time.Duration(a.ScaleDownAfter).String())
	} else if a.ScaleDownAfter > 0 && time.Duration(a.ScaleDownAfter) < MinScaleDownAfter {
		v.Add(prefix+".scaleDownAfter", "must be at least "+MinScaleDownAfter.String(), time.Duration(a.ScaleDownAfter).String())
	}
}

// GatewayDemand is what one gateway saw of one pool's traffic: the value
// of key [DemandKey](pool, gateway) in the fleet-demand bucket, written
// every few seconds while the gateway runs (the bucket's TTL drops the
// keys of a gateway that stopped). The planner sums the fresh values of a
// pool's keys to size an autoscaled pool.
type GatewayDemand struct {
	Pool    string `json:"pool"`
	Gateway string `json:"gateway"`
	// Connections is the largest number of client connections open at
	// once for the pool since the last report (open ones included).
	Connections int `json:"connections"`
	// RequestsPerSecond is the pool's request rate over the last report
	// interval.
	RequestsPerSecond float64   `json:"requestsPerSecond"`
	At                time.Time `json:"at"`
}

// DemandKey is the fleet-demand key of one gateway's demand for pool:
// "<pool>.<gateway>".
func DemandKey(pool, gateway string) string { return pool + "." + gateway }

// DemandFilter is the fleet-demand key filter of every gateway's demand
// for pool: "<pool>.*".
func DemandFilter(pool string) string { return pool + ".*" }

// GatewayCooldown is one proxy kept off one site: the value of key
// [CooldownKey](proxy, site) in the fleet-gateway-cooldowns bucket,
// written by the gateway whose cooldown rule decided it and read by every
// gateway, so none sends the site through the proxy until Until. An entry
// past its Until is ignored (the bucket drops it later).
type GatewayCooldown struct {
	Proxy string `json:"proxy"`
	Pool  string `json:"pool"`
	// Site is the registrable domain that banned the proxy.
	Site string `json:"site"`
	// Rule is the ban rule that matched.
	Rule    string    `json:"rule"`
	Gateway string    `json:"gateway"`
	At      time.Time `json:"at"`
	Until   time.Time `json:"until"`
}

// CooldownKey is the fleet-gateway-cooldowns key of proxy's cooldown on
// site: "<proxy>.<site in unpadded base64url>" (a site holds dots, which
// separate key tokens).
func CooldownKey(proxy, site string) string {
	return proxy + "." + base64.RawURLEncoding.EncodeToString([]byte(site))
}

// ProxyErrorHeader marks a response a proxy made itself rather than
// relayed (the origin unreachable through it). Every proxy proxyfleet runs
// sets it on its own error pages and removes it from the origin's
// responses (Squid by the lines of egress.SquidMarkOwnErrors), so a site
// cannot send it through. The gateway retries a 502, 503 or 504 on
// another proxy only when it carries it: a site's own 5xx is the site's
// answer, relayed as it is.
const ProxyErrorHeader = "X-Proxyfleet-Proxy-Error"

// SquidErrorHeader is the header Squid adds to the error pages it makes
// ("ERR_CONNECT_FAIL 111"). The gateway does not trust it: Squid relays
// an origin's copy.
const SquidErrorHeader = "X-Squid-Error"

// SuspectSubject is "fleet.health.suspect", where a gateway publishes a
// [Suspect] (core NATS, no stream): a proxy that failed a client's
// request; the health replica probing it probes it at once.
const SuspectSubject = "fleet.health.suspect"

// Suspect is the body of a message on [SuspectSubject].
type Suspect struct {
	ID     string `json:"id"`
	Reason string `json:"reason"`
}
