// Package route decides which proxy of a pool carries a client's
// connection: it parses the pool and session a client names in its
// Proxy-Authorization username, picks a ready proxy by the pool's strategy
// (round-robin, least-connections, random), and keeps sessions pinned to
// one proxy while it stays ready and the session is used.
//
// It holds no I/O: the gateway feeds it the ready proxies it sees in the
// fleet-proxies view ([Table.Set], [Table.Remove]) and asks it for a
// proxy per connection ([Table.Pick]).
package route

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/events"
)

// SessionPrefix separates a pool from its session in a username:
// "<pool>.session-<id>". Pool names cannot hold a '.', so the split is
// unambiguous.
const SessionPrefix = ".session-"

// MaxSessionID is the longest session id a client may name.
const MaxSessionID = 128

// Target is what a client's username selects: a pool, and a session when
// the client wants one proxy for a series of connections.
type Target struct {
	Pool    string
	Session string
}

// ParseUser splits a Proxy-Authorization username into pool and session.
// The pool must be a valid pool name; a session id is 1 to
// [MaxSessionID] characters of letters, digits, '-' and '_'.
func ParseUser(user string) (Target, error) {
	pool, session, hasSession := strings.Cut(user, SessionPrefix)
	if !hasSession && strings.Contains(user, ".") {
		return Target{}, fmt.Errorf("username %q: a '.' may only start %q", user, SessionPrefix)
	}
	if err := events.CheckIdentifier("pool", pool); err != nil {
		return Target{}, fmt.Errorf("username %q: the pool name %s (username is <pool> or <pool>.session-<id>)", user, err.Reason)
	}
	if !hasSession {
		return Target{Pool: pool}, nil
	}
	if session == "" || len(session) > MaxSessionID || strings.IndexFunc(session, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_')
	}) >= 0 {
		return Target{}, fmt.Errorf("username %q: a session id is 1-%d letters, digits, '-' or '_'", user, MaxSessionID)
	}
	return Target{Pool: pool, Session: session}, nil
}

// Proxy is one ready proxy as the gateway routes to it.
type Proxy struct {
	ID      string
	Pool    string
	Address string // host:port
	// Username is the basic-auth user the proxy demands ("" for none); the
	// password is the pool's, which the gateway opens from
	// fleet-gateway-creds.
	Username string
}

// ErrNoProxy is returned when a pool has no ready proxy to pick (beyond
// those the caller excludes).
var ErrNoProxy = errors.New("no ready proxy")

// Table holds the ready proxies of every pool, the pools' routing
// settings, the sessions and the open connections per proxy. It is safe
// for concurrent use.
type Table struct {
	now func() time.Time

	mu    sync.Mutex
	pools map[string]*pool
	// byID finds a proxy's pool when it leaves.
	byID map[string]string
}

type pool struct {
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
	// cool holds the proxies that failed a request lately and until when
	// new connections avoid them (see [Table.Cool]).
	cool map[string]time.Time
}

type session struct {
	proxy string
	until time.Time
}

// NewTable returns an empty table; now is the clock (time.Now when nil).
func NewTable(now func() time.Time) *Table {
	if now == nil {
		now = time.Now
	}
	return &Table{now: now, pools: map[string]*pool{}, byID: map[string]string{}}
}

func (t *Table) poolLocked(name string) *pool {
	p := t.pools[name]
	if p == nil {
		p = &pool{proxies: map[string]Proxy{}, open: map[string]int{}, sessions: map[string]*session{}, cool: map[string]time.Time{}}
		t.pools[name] = p
	}
	return p
}

// SetSpec records a pool's routing settings (nil: the defaults).
func (t *Table) SetSpec(name string, spec *events.GatewaySpec) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.poolLocked(name).spec = spec.Clone()
}

// Spec returns a pool's routing settings (nil: the defaults).
func (t *Table) Spec(name string) *events.GatewaySpec {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.pools[name]; p != nil {
		return p.spec.Clone()
	}
	return nil
}

// Set records x as ready (or its new address).
func (t *Table) Set(x Proxy) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if was, ok := t.byID[x.ID]; ok && was != x.Pool {
		t.removeLocked(x.ID)
	}
	p := t.poolLocked(x.Pool)
	if _, ok := p.proxies[x.ID]; !ok {
		i, _ := slices.BinarySearch(p.ids, x.ID)
		p.ids = slices.Insert(p.ids, i, x.ID)
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
	t.mu.Lock()
	defer t.mu.Unlock()
	name, ok := t.byID[id]
	if !ok {
		return false
	}
	p := t.pools[name]
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
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.byID))
	for id := range t.byID {
		out = append(out, id)
	}
	return out
}

// Ready returns the ready proxies of pool, sorted by id.
func (t *Table) Ready(name string) []Proxy {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pools[name]
	if p == nil {
		return nil
	}
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
// pool's session TTL. The caller reports the connection's end with
// [Table.Done].
func (t *Table) Pick(target Target, exclude ...string) (Proxy, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pools[target.Pool]
	if p == nil || len(p.ids) == 0 {
		return Proxy{}, fmt.Errorf("pool %q: %w", target.Pool, ErrNoProxy)
	}
	now := t.now()
	var s *session
	if target.Session != "" {
		s = p.sessions[target.Session]
		if s != nil && now.After(s.until) {
			s = nil
		}
		if s != nil {
			if x, ok := p.proxies[s.proxy]; ok && !slices.Contains(exclude, s.proxy) && (!coolingLocked(p, s.proxy, now) || t.allCoolingLocked(p, exclude, now)) {
				s.until = now.Add(p.spec.SessionTTLOrDefault())
				p.open[x.ID]++
				return x, nil
			}
		}
		t.expireLocked(p, now)
	}
	candidates := make([]string, 0, len(p.ids))
	for _, id := range p.ids {
		if !slices.Contains(exclude, id) {
			candidates = append(candidates, id)
		}
	}
	if len(candidates) == 0 {
		return Proxy{}, fmt.Errorf("pool %q: %w besides the %d tried", target.Pool, ErrNoProxy, len(exclude))
	}
	if len(p.cool) > 0 {
		warm := candidates[:0:0]
		for _, id := range candidates {
			if !coolingLocked(p, id, now) {
				warm = append(warm, id)
			}
		}
		if len(warm) > 0 {
			candidates = warm
		}
	}
	var id string
	switch p.spec.StrategyOrDefault() {
	case events.StrategyLeastConnections:
		// Ties go round-robin, so an idle pool still spreads.
		start := p.next % len(candidates)
		id = candidates[start]
		for i := range candidates {
			c := candidates[(start+i)%len(candidates)]
			if p.open[c] < p.open[id] {
				id = c
			}
		}
		p.next++
	case events.StrategyRandom:
		id = candidates[rand.IntN(len(candidates))]
	default:
		id = candidates[p.next%len(candidates)]
		p.next++
	}
	if target.Session != "" {
		p.sessions[target.Session] = &session{proxy: id, until: now.Add(p.spec.SessionTTLOrDefault())}
	}
	p.open[id]++
	return p.proxies[id], nil
}

// allCoolingLocked reports whether every proxy of p not in exclude is
// cooling.
func (t *Table) allCoolingLocked(p *pool, exclude []string, now time.Time) bool {
	for _, id := range p.ids {
		if !slices.Contains(exclude, id) && !coolingLocked(p, id, now) {
			return false
		}
	}
	return true
}

// expireLocked drops the pool's sessions past their TTL.
func (t *Table) expireLocked(p *pool, now time.Time) {
	for k, s := range p.sessions {
		if now.After(s.until) {
			delete(p.sessions, k)
		}
	}
}

// Done records the end of a connection [Table.Pick] gave to proxy x.
func (t *Table) Done(x Proxy) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pools[x.Pool]
	if p == nil {
		return
	}
	if p.open[x.ID] <= 1 {
		delete(p.open, x.ID)
		return
	}
	p.open[x.ID]--
}

// Open returns the connections open per proxy of pool.
func (t *Table) Open(name string) map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]int{}
	if p := t.pools[name]; p != nil {
		for id, n := range p.open {
			out[id] = n
		}
	}
	return out
}

// Sessions returns the number of live sessions of pool.
func (t *Table) Sessions(name string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pools[name]
	if p == nil {
		return 0
	}
	t.expireLocked(p, t.now())
	return len(p.sessions)
}
