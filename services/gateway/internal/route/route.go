// Package route decides which proxy of a pool carries a client's
// connection: it parses the pool, the proxy labels and the session a
// client names in its Proxy-Authorization username ([UserGrammar]), picks
// a ready proxy that carries those labels by the pool's strategy
// (round-robin, least-connections, random), and keeps sessions pinned to
// one proxy while it stays ready and the session is used.
//
// It also holds each proxy to the pool's per-site limits (politeness:
// requests in flight and requests per second per proxy per site, see
// [Table.Acquire]) and rotates sessions after a number of uses or an age
// ([events.SessionRotation]).
//
// It holds no I/O: the gateway feeds it the ready proxies it sees in the
// fleet-proxies view ([Table.Set], [Table.Remove]) and asks it for a
// proxy per connection ([Table.Pick]). Sessions shared with other
// gateways come and go through hooks ([Table.SetSessionHook],
// [Table.ApplySession], [Table.TakeSession]); the NATS side is the
// caller's.
package route

import (
	"container/list"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"proxyfleet/pkg/events"
)

// SessionPrefix separates a pool (or its last label) from its session in
// a username: "<pool>.session-<id>". Pool names cannot hold a '.', so the
// split is unambiguous.
const SessionPrefix = ".session-"

// MaxSessionID is the longest session id a client may name.
const MaxSessionID = 128

// Bounds of the labels a username selects.
const (
	// MaxLabels is how many labels one username may select.
	MaxLabels = 8
	// MaxLabelName and MaxLabelValue bound a label's name and value.
	MaxLabelName  = 32
	MaxLabelValue = 64
)

// UserGrammar is the grammar of a client's username, quoted by every
// error of [ParseUser].
const UserGrammar = "<pool>[.<label>-<value>]...[.session-<id>]: labels in any order, each at most once, the session last"

// Label is one label a client selects proxies by: a proxy serves it only
// when its labels hold Name with Value.
type Label struct {
	Name, Value string
}

func (l Label) String() string { return l.Name + "=" + l.Value }

// Target is what a client's username selects: a pool, the labels its
// proxies must carry (sorted by name), and a session when the client wants
// one proxy for a series of connections. Client, set by the caller (the
// client's address), is whom the session counts against
// ([Limits.SessionsPerClient]).
//
// Site, set by the caller (site.Key of the request's host, or of a
// CONNECT's), is the site the pool's per-site limits apply to; "" for
// none.
type Target struct {
	Pool    string
	Labels  []Label
	Session string
	Client  string
	Site    string
}

// SessionKey is the key of the target's session in its pool: the session
// id, followed by ".<label>-<value>" per selected label in name order. A
// session id named with two selections is two sessions, each kept within
// its selection. "" without a session.
func (t Target) SessionKey() string {
	if t.Session == "" || len(t.Labels) == 0 {
		return t.Session
	}
	var b strings.Builder
	b.WriteString(t.Session)
	for _, l := range t.Labels {
		b.WriteString("." + l.Name + "-" + l.Value)
	}
	return b.String()
}

// Selection names the target's labels as "name=value", joined by " and "
// ("" for none).
func (t Target) Selection() string {
	parts := make([]string, len(t.Labels))
	for i, l := range t.Labels {
		parts[i] = l.String()
	}
	return strings.Join(parts, " and ")
}

// Matches reports whether proxy x carries every label t selects.
func (t Target) Matches(x Proxy) bool {
	for _, l := range t.Labels {
		if v, ok := x.Labels[l.Name]; !ok || v != l.Value {
			return false
		}
	}
	return true
}

// ParseUser parses a Proxy-Authorization username by [UserGrammar]: the
// pool (a valid pool name), then any labels, "<label>-<value>" each (a
// label name is 1 to [MaxLabelName] lowercase letters, digits or '_'; a
// value 1 to [MaxLabelValue] letters, digits, '-' or '_', compared
// exactly), then an optional session "session-<id>" (1 to [MaxSessionID]
// letters, digits, '-' and '_'). "session" is no label name. The labels
// come back sorted by name.
func ParseUser(user string) (Target, error) {
	parts := strings.Split(user, ".")
	if err := events.CheckIdentifier("pool", parts[0]); err != nil {
		return Target{}, fmt.Errorf("username %q: the pool name %s (username is %s)", user, err.Reason, UserGrammar)
	}
	t := Target{Pool: parts[0]}
	for i, part := range parts[1:] {
		name, value, ok := strings.Cut(part, "-")
		if !ok || name == "" {
			return Target{}, fmt.Errorf("username %q: %q is neither <label>-<value> nor session-<id> (username is %s)", user, part, UserGrammar)
		}
		if name == "session" {
			if i != len(parts)-2 {
				return Target{}, fmt.Errorf("username %q: the session comes last (username is %s)", user, UserGrammar)
			}
			if !validValue(value, MaxSessionID) {
				return Target{}, fmt.Errorf("username %q: a session id is 1-%d letters, digits, '-' or '_' (username is %s)", user, MaxSessionID, UserGrammar)
			}
			t.Session = value
			continue
		}
		if len(name) > MaxLabelName || strings.IndexFunc(name, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_')
		}) >= 0 {
			return Target{}, fmt.Errorf("username %q: the label name %q must be 1-%d lowercase letters, digits or '_' (username is %s)", user, name, MaxLabelName, UserGrammar)
		}
		if !validValue(value, MaxLabelValue) {
			return Target{}, fmt.Errorf("username %q: the value of label %s must be 1-%d letters, digits, '-' or '_' (username is %s)", user, name, MaxLabelValue, UserGrammar)
		}
		if slices.ContainsFunc(t.Labels, func(l Label) bool { return l.Name == name }) {
			return Target{}, fmt.Errorf("username %q: label %s is selected twice (username is %s)", user, name, UserGrammar)
		}
		if len(t.Labels) == MaxLabels {
			return Target{}, fmt.Errorf("username %q: at most %d labels may be selected", user, MaxLabels)
		}
		t.Labels = append(t.Labels, Label{Name: name, Value: value})
	}
	slices.SortFunc(t.Labels, func(a, b Label) int { return strings.Compare(a.Name, b.Name) })
	return t, nil
}

// validValue reports whether v is 1 to most letters, digits, '-' or '_'.
func validValue(v string, most int) bool {
	return v != "" && len(v) <= most && strings.IndexFunc(v, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_')
	}) < 0
}

// SelectionError says that no ready proxy of Pool carries the labels a
// client selected. It matches [ErrNoProxy].
type SelectionError struct {
	Pool   string
	Target Target
}

func (e *SelectionError) Error() string {
	return fmt.Sprintf("no ready proxy of pool %q has %s", e.Pool, e.Target.Selection())
}

// Unwrap makes a SelectionError match [ErrNoProxy].
func (e *SelectionError) Unwrap() error { return ErrNoProxy }

// Proxy is one ready proxy as the gateway routes to it.
type Proxy struct {
	ID      string
	Pool    string
	Address string // host:port
	// Username is the basic-auth user the proxy demands ("" for none); the
	// password is the pool's, which the gateway opens from
	// fleet-gateway-creds.
	Username string
	// Labels are the labels of the proxy's target (region, country, …)
	// that clients select it by.
	Labels map[string]string
	// Site, in a Proxy [Table.Pick] returned, is the site the connection
	// counts against until [Table.Done] ("" when it counts against none).
	Site string
}

// ErrNoProxy is returned when a pool has no ready proxy to pick (beyond
// those the caller excludes).
var ErrNoProxy = errors.New("no ready proxy")

// Default bounds of the session table (see [Limits]).
const (
	DefaultSessionsPerPool   = 100_000
	DefaultSessionsPerClient = 10_000
)

// Limits bounds the sessions a [Table] keeps. When a new session would
// pass a bound, the least recently used session of that pool (or of that
// client in the pool) is forgotten: its next connection is pinned afresh,
// as after its TTL. Zero values take the defaults.
type Limits struct {
	// SessionsPerPool bounds a pool's sessions (default
	// [DefaultSessionsPerPool]).
	SessionsPerPool int
	// SessionsPerClient bounds the sessions one client (Target.Client)
	// holds in a pool (default [DefaultSessionsPerClient]).
	SessionsPerClient int
}

// Table holds the ready proxies of every pool, the pools' routing
// settings, the sessions and the open connections per proxy. It is safe
// for concurrent use.
//
// Locks: t.mu guards the pools and byID maps (a pool, once made, stays);
// each pool's mu guards that pool. t.mu is taken before a pool's mu,
// never after; a pick holds only its pool's lock.
type Table struct {
	now    func() time.Time
	limits Limits
	// hook is told of session changes to share (see [Table.SetSessionHook]).
	hook atomic.Pointer[SessionHook]

	mu    sync.RWMutex
	pools map[string]*pool
	// byID finds a proxy's pool when it leaves.
	byID map[string]string
}

type pool struct {
	mu   sync.Mutex
	spec *events.GatewaySpec
	// ids are the pool's ready proxies, sorted, so round-robin visits
	// them in a stable order.
	ids     []string
	proxies map[string]Proxy
	// open counts the connections the gateway carries per proxy
	// (least-connections).
	open     map[string]int
	next     int
	sessions map[string]*session
	// lru holds the sessions, most recently used first. Every use renews
	// a session for the same TTL, so the least recently used is also the
	// first to expire: expiry pops from the back (O(1) per session).
	lru *list.List
	// byClient holds each client's sessions, most recently used first.
	byClient map[string]*list.List
	// cool holds the proxies that failed a request lately and until when
	// new connections avoid them (see [Table.Cool]).
	cool map[string]time.Time
	// sites holds the per-site counts and token buckets of the pool's
	// proxies (see persite.go); swept is when idle sites were last dropped.
	sites map[string]*siteState
	swept time.Time
}

type session struct {
	id     string
	client string
	proxy  string
	used   time.Time
	// pinned is when the session was pinned to proxy; uses counts its
	// uses since (rotation), synced the part of uses another gateway
	// already knows (see [Table.ApplySession]).
	pinned       time.Time
	uses, synced int
	// shared is when the session was last shared with (or learnt from)
	// the other gateways.
	shared time.Time
	// remote is a session learnt from another gateway and not used by a
	// client here yet: it counts against no client.
	remote bool
	// inPool and inClient are the session's elements in pool.lru and in
	// its client's list (inClient nil when remote).
	inPool, inClient *list.Element
}

// NewTable returns an empty table bounded by limits; now is the clock
// (time.Now when nil).
func NewTable(limits Limits, now func() time.Time) *Table {
	if now == nil {
		now = time.Now
	}
	if limits.SessionsPerPool <= 0 {
		limits.SessionsPerPool = DefaultSessionsPerPool
	}
	if limits.SessionsPerClient <= 0 {
		limits.SessionsPerClient = DefaultSessionsPerClient
	}
	return &Table{now: now, limits: limits, pools: map[string]*pool{}, byID: map[string]string{}}
}

// poolLocked returns pool name, made if new; t.mu is held for writing.
func (t *Table) poolLocked(name string) *pool {
	p := t.pools[name]
	if p == nil {
		p = &pool{
			proxies: map[string]Proxy{}, open: map[string]int{}, sessions: map[string]*session{},
			lru: list.New(), byClient: map[string]*list.List{}, cool: map[string]time.Time{},
			sites: map[string]*siteState{},
		}
		t.pools[name] = p
	}
	return p
}

// pool returns pool name, or nil.
func (t *Table) pool(name string) *pool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.pools[name]
}

// SetSpec records a pool's routing settings (nil: the defaults).
func (t *Table) SetSpec(name string, spec *events.GatewaySpec) {
	t.mu.Lock()
	p := t.poolLocked(name)
	t.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.spec = spec.Clone()
}

// Spec returns a pool's routing settings (nil: the defaults).
func (t *Table) Spec(name string) *events.GatewaySpec {
	p := t.pool(name)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.spec.Clone()
}

// Fallback returns a pool's fallback pools (gateway.fallback), not to be
// changed.
func (t *Table) Fallback(name string) []string {
	p := t.pool(name)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.spec.FallbackPools()
}

// Set records x as ready (or its new address).
func (t *Table) Set(x Proxy) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if was, ok := t.byID[x.ID]; ok && was != x.Pool {
		t.removeLocked(x.ID)
	}
	p := t.poolLocked(x.Pool)
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.proxies[x.ID]; !ok {
		i, _ := slices.BinarySearch(p.ids, x.ID)
		p.ids = slices.Insert(p.ids, i, x.ID)
		// Requests waiting for a proxy under its per-site limits may
		// take this one.
		p.wakeAllLocked()
	}
	p.proxies[x.ID] = x
	t.byID[x.ID] = x.Pool
}

// Remove forgets proxy id: it left ready. Sessions pinned to it move to
// another proxy at their next connection.
func (t *Table) Remove(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.removeLocked(id)
}

func (t *Table) removeLocked(id string) {
	name, ok := t.byID[id]
	if !ok {
		return
	}
	delete(t.byID, id)
	p := t.pools[name]
	p.mu.Lock()
	defer p.mu.Unlock()
	if i, found := slices.BinarySearch(p.ids, id); found {
		p.ids = slices.Delete(p.ids, i, i+1)
	}
	delete(p.proxies, id)
	delete(p.cool, id)
}

// Cool has new connections avoid proxy id for d: it failed a request, and
// until health's probes decide, the pool's other proxies are tried first
// (a proxy that vanished without a reset would cost each request routed
// to it a whole dial timeout). When every candidate is cooling, they are
// used all the same. It reports whether id was not cooling already, so
// the caller reports a failing proxy once per cooling period.
func (t *Table) Cool(id string, d time.Duration) bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	name, ok := t.byID[id]
	if !ok {
		return false
	}
	p := t.pools[name]
	p.mu.Lock()
	defer p.mu.Unlock()
	now := t.now()
	was := p.cool[id]
	p.cool[id] = now.Add(d)
	return !now.Before(was)
}

// coolingLocked reports whether proxy id of p is avoided at now.
func coolingLocked(p *pool, id string, now time.Time) bool {
	until, ok := p.cool[id]
	if ok && !now.Before(until) {
		delete(p.cool, id)
		return false
	}
	return ok
}

// IDs returns the ids of every ready proxy the table holds.
func (t *Table) IDs() []string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]string, 0, len(t.byID))
	for id := range t.byID {
		out = append(out, id)
	}
	return out
}

// Ready returns the ready proxies of pool, sorted by id.
func (t *Table) Ready(name string) []Proxy {
	p := t.pool(name)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Proxy, 0, len(p.ids))
	for _, id := range p.ids {
		out = append(out, p.proxies[id])
	}
	return out
}

// Pick returns the proxy that carries a new connection of target, not one
// of exclude (the proxies a failed attempt already tried). A session
// keeps its proxy while that proxy is ready and not excluded, and is
// pinned to the picked proxy otherwise; each pick renews it for the
// pool's session TTL and counts one use of it, and a session due for
// rotation ([events.SessionRotation]) moves to another proxy.
//
// With per-site limits ([events.PerSite]) and a target.Site, only a proxy
// under its limits for that site is picked, and the pick counts against
// them; when every usable proxy is at its limit (or a session's proxy
// is), Pick returns a [*LimitError] at once ([Table.Acquire] waits). The
// caller reports the connection's end with [Table.Done].
func (t *Table) Pick(target Target, exclude ...string) (Proxy, error) {
	x, changed, err := t.pick(target, exclude)
	if changed != sessionSame {
		t.tell(target.Pool, target.SessionKey(), changed == sessionMoved)
	}
	return x, err
}

// What a pick did to its session, for [SessionHook].
const (
	sessionSame = iota
	sessionUsed
	sessionMoved
)

func (t *Table) pick(target Target, exclude []string) (Proxy, int, error) {
	p := t.pool(target.Pool)
	if p == nil {
		return Proxy{}, sessionSame, fmt.Errorf("pool %q: %w", target.Pool, ErrNoProxy)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ids) == 0 {
		return Proxy{}, sessionSame, fmt.Errorf("pool %q: %w", target.Pool, ErrNoProxy)
	}
	ids := p.ids
	if len(target.Labels) > 0 {
		ids = make([]string, 0, len(p.ids))
		for _, id := range p.ids {
			if target.Matches(p.proxies[id]) {
				ids = append(ids, id)
			}
		}
		if len(ids) == 0 {
			return Proxy{}, sessionSame, &SelectionError{Pool: target.Pool, Target: target}
		}
	}
	now := t.now()
	lim := p.limiterLocked(target, now)
	var avoid string
	if target.Session != "" {
		expireLocked(p, now)
		if s := p.sessions[target.SessionKey()]; s != nil {
			if x, ok := p.proxies[s.proxy]; ok && target.Matches(x) && !slices.Contains(exclude, s.proxy) && (!coolingLocked(p, s.proxy, now) || t.allCoolingLocked(p, ids, exclude, now)) {
				if !rotationDue(p.spec, s, now) {
					// A session waits for its own proxy rather than
					// leave it for the site's load.
					if !lim.under(s.proxy) {
						return Proxy{}, sessionSame, lim.err()
					}
					t.adoptLocked(p, s, target.Client)
					p.touchLocked(s, now)
					s.uses++
					lim.take(s.proxy)
					p.open[x.ID]++
					x.Site = lim.site()
					if shareUse(p.spec, s, now) {
						return x, sessionUsed, nil
					}
					return x, sessionSame, nil
				}
				avoid = s.proxy
			}
		}
	}
	candidates := make([]string, 0, len(ids))
	for _, id := range ids {
		if !slices.Contains(exclude, id) {
			candidates = append(candidates, id)
		}
	}
	if len(candidates) == 0 {
		return Proxy{}, sessionSame, fmt.Errorf("pool %q: %w besides the %d tried", target.Pool, ErrNoProxy, len(exclude))
	}
	if avoid != "" && !slices.ContainsFunc(candidates, func(id string) bool { return id != avoid }) {
		avoid = "" // the session's proxy is the only one: it stays there
	}
	// usable: not the proxy a rotating session leaves, under the site's
	// limits; warm ones first (see [Table.Cool]).
	usable := func(id string, warm bool) bool {
		return id != avoid && (!warm || !coolingLocked(p, id, now)) && lim.under(id)
	}
	id, ok := p.chooseLocked(candidates, func(id string) bool { return usable(id, true) })
	if !ok {
		id, ok = p.chooseLocked(candidates, func(id string) bool { return usable(id, false) })
	}
	if !ok {
		return Proxy{}, sessionSame, lim.err()
	}
	changed := sessionSame
	if target.Session != "" {
		t.pinLocked(p, target, id, now)
		changed = sessionMoved
	}
	lim.take(id)
	p.open[id]++
	x := p.proxies[id]
	x.Site = lim.site()
	return x, changed, nil
}

// chooseLocked picks one of candidates that ok accepts, by the pool's
// strategy; false when ok accepts none.
func (p *pool) chooseLocked(candidates []string, ok func(string) bool) (string, bool) {
	n := len(candidates)
	switch p.spec.StrategyOrDefault() {
	case events.StrategyLeastConnections:
		// Ties go round-robin, so an idle pool still spreads.
		start := p.next % n
		id := ""
		for i := range n {
			c := candidates[(start+i)%n]
			if ok(c) && (id == "" || p.open[c] < p.open[id]) {
				id = c
			}
		}
		if id == "" {
			return "", false
		}
		p.next++
		return id, true
	case events.StrategyRandom:
		start := rand.IntN(n)
		for i := range n {
			if c := candidates[(start+i)%n]; ok(c) {
				return c, true
			}
		}
		return "", false
	default:
		// In turn from the pool's position: a proxy skipped (at its
		// limit, or the one a session leaves) keeps its turn for later.
		start := p.next % n
		for i := range n {
			if c := candidates[(start+i)%n]; ok(c) {
				p.next++
				return c, true
			}
		}
		return "", false
	}
}

// rotationDue reports whether session s must move to another proxy by the
// pool's rotation settings.
func rotationDue(spec *events.GatewaySpec, s *session, now time.Time) bool {
	if spec == nil || spec.Session == nil {
		return false
	}
	r := spec.Session
	return r.MaxRequests > 0 && s.uses >= r.MaxRequests || r.MaxAge > 0 && !now.Before(s.pinned.Add(time.Duration(r.MaxAge)))
}

// shareUse reports whether a use of s is worth telling the other gateways
// of: its uses count towards rotation, or their copy of its last use is
// a quarter of the TTL old (they would forget it).
func shareUse(spec *events.GatewaySpec, s *session, now time.Time) bool {
	if spec != nil && spec.Session != nil && spec.Session.MaxRequests > 0 {
		return true
	}
	return now.Sub(s.shared) >= spec.SessionTTLOrDefault()/4
}

// allCoolingLocked reports whether every proxy of ids (of p) not in
// exclude is cooling.
func (t *Table) allCoolingLocked(p *pool, ids, exclude []string, now time.Time) bool {
	for _, id := range ids {
		if !slices.Contains(exclude, id) && !coolingLocked(p, id, now) {
			return false
		}
	}
	return true
}

// expireLocked drops the pool's sessions past their TTL: they sit at the
// back of p.lru, so it stops at the first live one.
func expireLocked(p *pool, now time.Time) {
	ttl := p.spec.SessionTTLOrDefault()
	for e := p.lru.Back(); e != nil; e = p.lru.Back() {
		s := e.Value.(*session)
		if !now.After(s.used.Add(ttl)) {
			return
		}
		p.dropLocked(s)
	}
}

// touchLocked records a use of s at now.
func (p *pool) touchLocked(s *session, now time.Time) {
	s.used = now
	p.lru.MoveToFront(s.inPool)
	if s.inClient != nil {
		p.byClient[s.client].MoveToFront(s.inClient)
	}
}

// adoptLocked has a session learnt from another gateway count against the
// client that uses it here.
func (t *Table) adoptLocked(p *pool, s *session, client string) {
	if !s.remote {
		return
	}
	mine := p.byClient[client]
	if mine != nil && mine.Len() >= t.limits.SessionsPerClient {
		p.dropLocked(mine.Back().Value.(*session))
		mine = p.byClient[client]
	}
	if mine == nil {
		mine = list.New()
		p.byClient[client] = mine
	}
	s.remote, s.client = false, client
	s.inClient = mine.PushFront(s)
}

// pinLocked pins target's session to proxy id (a new session, or one that
// moves), first forgetting the least recently used session of the pool
// or of the client when a new one would pass [Limits]. The pin is the
// session's first use on id.
func (t *Table) pinLocked(p *pool, target Target, id string, now time.Time) {
	key := target.SessionKey()
	if s := p.sessions[key]; s != nil {
		if s.client == target.Client && !s.remote {
			s.proxy, s.pinned, s.uses, s.synced = id, now, 1, 0
			p.touchLocked(s, now)
			return
		}
		// Another client names the same session (or a client here takes
		// over one learnt from another gateway): it counts against the
		// client that uses it now.
		p.dropLocked(s)
	}
	// The client's own bound first: a client at its bound replaces one of
	// its sessions, not another client's.
	if mine := p.byClient[target.Client]; mine != nil && mine.Len() >= t.limits.SessionsPerClient {
		p.dropLocked(mine.Back().Value.(*session))
	}
	if p.lru.Len() >= t.limits.SessionsPerPool {
		p.dropLocked(p.lru.Back().Value.(*session))
	}
	mine := p.byClient[target.Client]
	if mine == nil {
		mine = list.New()
		p.byClient[target.Client] = mine
	}
	s := &session{id: key, client: target.Client, proxy: id, used: now, pinned: now, uses: 1}
	s.inPool = p.lru.PushFront(s)
	s.inClient = mine.PushFront(s)
	p.sessions[s.id] = s
}

// dropLocked forgets session s.
func (p *pool) dropLocked(s *session) {
	delete(p.sessions, s.id)
	p.lru.Remove(s.inPool)
	if s.inClient == nil {
		return
	}
	mine := p.byClient[s.client]
	mine.Remove(s.inClient)
	if mine.Len() == 0 {
		delete(p.byClient, s.client)
	}
}

// Done records the end of a connection [Table.Pick] gave to proxy x: it
// no longer counts against x's limits for its site.
func (t *Table) Done(x Proxy) {
	p := t.pool(x.Pool)
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if x.Site != "" {
		p.releaseLocked(x.ID, x.Site)
	}
	if p.open[x.ID] <= 1 {
		delete(p.open, x.ID)
		return
	}
	p.open[x.ID]--
}

// Open returns the connections open per proxy of pool.
func (t *Table) Open(name string) map[string]int {
	out := map[string]int{}
	p := t.pool(name)
	if p == nil {
		return out
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, n := range p.open {
		out[id] = n
	}
	return out
}

// Sessions returns the number of live sessions of pool.
func (t *Table) Sessions(name string) int {
	p := t.pool(name)
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	expireLocked(p, t.now())
	return len(p.sessions)
}
