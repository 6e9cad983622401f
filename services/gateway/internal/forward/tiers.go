package forward

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"time"

	"proxyfleet/services/gateway/internal/route"
)

// PoolHeader names the pool whose proxy carried an answer: the pool the
// client named, or the fallback pool (tier) that served it.
const PoolHeader = "X-Proxyfleet-Pool"

// maxTiers bounds the pools one request may go through: its own and the
// fallback pools reached from it.
const maxTiers = 8

// maxTierSites bounds the sites the tier memory holds; past it, expired
// entries are dropped first, then arbitrary ones.
const maxTierSites = 100_000

// chain returns the pools a request naming pool may be served by, in
// order: pool, then each pool of its gateway.fallback followed by that
// pool's own fallbacks (depth first). No pool is visited twice, so a
// cycle of fallbacks across pools ends; pools that do not exist are
// skipped; at most maxTiers pools.
func (s *Server) chain(pool string) []string {
	out := []string{pool}
	var visit func(name string)
	visit = func(name string) {
		for _, next := range s.cfg.Table.Fallback(name) {
			if len(out) == maxTiers {
				return
			}
			if slices.Contains(out, next) || !s.cfg.Fleet.Known(next) {
				continue
			}
			out = append(out, next)
			visit(next)
		}
	}
	visit(pool)
	return out
}

// tiers returns the pools a request of target (its pool and labels) to
// site goes through: its pool's chain, from the tier the site needed
// lately when the tier memory holds one.
func (s *Server) tiers(target route.Target, site string) []string {
	chain := s.chain(target.Pool)
	if len(chain) == 1 || site == "" {
		return chain
	}
	if tier := s.tierMemory.get(memoryKey(target), site, s.now()); tier != "" {
		if i := slices.Index(chain, tier); i > 0 {
			return chain[i:]
		}
	}
	return chain
}

// served records that a request of target to site, which started at
// tier start, was served by tier: when that is a later fallback pool, the
// site's requests of target's pool and labels start there for the pool's
// tierMemory.
func (s *Server) served(target route.Target, site, tier, start string) {
	if tier == "" || tier == target.Pool || tier == start || site == "" {
		return
	}
	now := s.now()
	memory := s.cfg.Table.Spec(target.Pool).TierMemoryOrDefault()
	s.tierMemory.set(memoryKey(target), site, tier, now.Add(memory), now)
	s.cfg.Log.Info("site served by a fallback pool; its requests start there for a while", "pool", target.Pool, "labels", target.Selection(), "site", site, "tier", tier, "for", memory.String())
}

// TierEntry is one site that starts at a fallback pool for a while.
type TierEntry struct {
	// Pool and Labels are the pool the clients named and the labels they
	// selected ("name=value" joined by " and "; "" for none).
	Pool   string    `json:"pool"`
	Labels string    `json:"labels,omitempty"`
	Site   string    `json:"site"`
	Tier   string    `json:"tier"`
	Until  time.Time `json:"until"`
}

// Tiers returns the sites that start at a fallback pool now.
func (s *Server) Tiers() []TierEntry {
	now := s.now()
	s.tierMemory.mu.Lock()
	defer s.tierMemory.mu.Unlock()
	out := make([]TierEntry, 0, len(s.tierMemory.sites))
	for k, e := range s.tierMemory.sites {
		if !now.Before(e.until) {
			continue
		}
		pool, labels, _ := strings.Cut(k.pool, " ")
		out = append(out, TierEntry{Pool: pool, Labels: labels, Site: k.site, Tier: e.tier, Until: e.until})
	}
	slices.SortFunc(out, func(a, b TierEntry) int {
		return cmp.Or(strings.Compare(a.Pool, b.Pool), strings.Compare(a.Site, b.Site), strings.Compare(a.Labels, b.Labels))
	})
	return out
}

// memoryKey is what the tier memory tells requests apart by, besides the
// site: the pool and the labels selected (a site may need a fallback for
// one region and not for another).
func memoryKey(target route.Target) string {
	if len(target.Labels) == 0 {
		return target.Pool
	}
	return target.Pool + " " + target.Selection()
}

func (s *Server) now() time.Time {
	if s.cfg.Now != nil {
		return s.cfg.Now()
	}
	return time.Now()
}

// tierMemory remembers, per pool and site, the fallback pool the site
// needed lately and until when requests start there. It is each
// gateway's own, in memory.
type tierMemory struct {
	mu    sync.Mutex
	sites map[tierKey]tierEntry
}

type tierKey struct{ pool, site string }

type tierEntry struct {
	tier  string
	until time.Time
}

// get returns the tier requests of pool to site start at now ("" for
// pool itself).
func (m *tierMemory) get(pool, site string, now time.Time) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.sites[tierKey{pool, site}]
	if !ok {
		return ""
	}
	if !now.Before(e.until) {
		delete(m.sites, tierKey{pool, site})
		return ""
	}
	return e.tier
}

// set has requests of pool to site start at tier until until.
func (m *tierMemory) set(pool, site, tier string, until, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sites == nil {
		m.sites = map[tierKey]tierEntry{}
	}
	k := tierKey{pool, site}
	if _, ok := m.sites[k]; !ok && len(m.sites) >= maxTierSites {
		for k, e := range m.sites {
			if !now.Before(e.until) {
				delete(m.sites, k)
			}
		}
		for k := range m.sites {
			if len(m.sites) < maxTierSites {
				break
			}
			delete(m.sites, k)
		}
	}
	m.sites[k] = tierEntry{tier: tier, until: until}
}
