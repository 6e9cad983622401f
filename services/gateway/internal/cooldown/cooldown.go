// Package cooldown holds the per-site cooldowns of a gateway's proxies: a
// proxy a site banned (a cooldown ban rule's verdict) is kept off that
// site, its registrable domain (site.Key), until its cooldown ends, and
// serves every other site meanwhile. It answers which proxies are cooled
// for a site and on how many sites a proxy was cooled lately (a pool's
// retireAfterSites).
//
// These are not route.Table.Cool's cooldowns, which keep a proxy that
// failed a request off every site for seconds while health probes it.
//
// It holds no I/O: the gateway adds the cooldowns it decides and those
// other gateways wrote to the fleet-gateway-cooldowns bucket.
package cooldown

import (
	"sync"
	"time"
)

// Entry is one proxy kept off one site.
type Entry struct {
	Proxy string
	Pool  string
	Site  string
	// Rule is the ban rule whose verdict cooled the proxy.
	Rule string
	// At is when the proxy was cooled; Until when its cooldown ends.
	At, Until time.Time
}

// Set is the cooldowns a gateway knows. It is safe for concurrent use.
type Set struct {
	now    func() time.Time
	retain time.Duration

	// mu is read-locked by the lookups every request makes.
	mu sync.RWMutex
	// bySite holds each site's entries by proxy; byProxy the same
	// entries by proxy, then site.
	bySite  map[string]map[string]*Entry
	byProxy map[string]map[string]*Entry
	pruned  time.Time
}

// pruneEvery is how often the set drops the entries it no longer needs.
const pruneEvery = time.Minute

// NewSet returns an empty set that keeps an entry until its cooldown ended
// and it is older than retain (the longest span [Set.Sites] is asked to
// count over); now is the clock (time.Now when nil).
func NewSet(retain time.Duration, now func() time.Time) *Set {
	if now == nil {
		now = time.Now
	}
	return &Set{now: now, retain: retain, bySite: map[string]map[string]*Entry{}, byProxy: map[string]map[string]*Entry{}}
}

// Add records e. Of two entries for one proxy and site the one that ends
// later stays (with the earlier At of the two, when both cool it now, so
// a cooldown extended is still counted from its start). It reports
// whether e changed the set: a proxy newly cooled, or cooled for longer.
func (s *Set) Add(e Entry) bool {
	if e.Proxy == "" || e.Site == "" {
		return false
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if now.Sub(s.pruned) >= pruneEvery {
		s.pruneLocked(now)
	}
	if was := s.bySite[e.Site][e.Proxy]; was != nil {
		if !e.Until.After(was.Until) {
			return false
		}
		if now.Before(was.Until) && was.At.Before(e.At) {
			e.At = was.At
		}
	}
	if s.bySite[e.Site] == nil {
		s.bySite[e.Site] = map[string]*Entry{}
	}
	if s.byProxy[e.Proxy] == nil {
		s.byProxy[e.Proxy] = map[string]*Entry{}
	}
	s.bySite[e.Site][e.Proxy] = &e
	s.byProxy[e.Proxy][e.Site] = &e
	return true
}

// Remove drops proxy's entry for site.
func (s *Set) Remove(proxy, site string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.removeLocked(proxy, site)
}

func (s *Set) removeLocked(proxy, site string) {
	delete(s.bySite[site], proxy)
	if len(s.bySite[site]) == 0 {
		delete(s.bySite, site)
	}
	delete(s.byProxy[proxy], site)
	if len(s.byProxy[proxy]) == 0 {
		delete(s.byProxy, proxy)
	}
}

// Cooled returns the proxies of pool cooled for site now, and the end of
// the earliest of their cooldowns (zero when none). A cooldown ends at its
// Until exactly.
func (s *Set) Cooled(pool, site string) (ids []string, first time.Time) {
	now := s.now()
	s.mu.RLock()
	defer s.mu.RUnlock()
	for id, e := range s.bySite[site] {
		if e.Pool != pool || !now.Before(e.Until) {
			continue
		}
		ids = append(ids, id)
		if first.IsZero() || e.Until.Before(first) {
			first = e.Until
		}
	}
	return ids, first
}

// Sites returns on how many distinct sites proxy was cooled within the
// last window (cooldowns that ended since included).
func (s *Set) Sites(proxy string, window time.Duration) int {
	now := s.now()
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := 0
	for _, e := range s.byProxy[proxy] {
		if now.Sub(e.At) < window {
			n++
		}
	}
	return n
}

// Entries returns a copy of every entry the set holds.
func (s *Set) Entries() []Entry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []Entry
	for _, sites := range s.byProxy {
		for _, e := range sites {
			out = append(out, *e)
		}
	}
	return out
}

// pruneLocked drops the entries whose cooldown ended and that are older
// than retain.
func (s *Set) pruneLocked(now time.Time) {
	s.pruned = now
	for proxy, sites := range s.byProxy {
		for site, e := range sites {
			if !now.Before(e.Until) && now.Sub(e.At) >= s.retain {
				s.removeLocked(proxy, site)
			}
		}
	}
}
