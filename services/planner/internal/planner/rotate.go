package planner

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"sort"
	"time"

	"proxyfleet/pkg/events"
)

// rotationJitter is the extra age, up to a tenth of maxAge, a proxy may
// reach before it is rotated. It is derived from the proxy id alone, so
// every replica computes the same value and a restart does not re-roll it;
// it spreads the rotation of proxies created together.
func rotationJitter(id string, maxAge time.Duration) time.Duration {
	span := maxAge / 10
	if span <= 0 {
		return 0
	}
	sum := sha256.Sum256([]byte(id))
	return time.Duration(binary.BigEndian.Uint64(sum[:8]) % uint64(span+1))
}

// isAged reports whether proxy x, requested at x.Created, is older than
// maxAge plus its jitter at now.
func isAged(x Proxy, maxAge time.Duration, now time.Time) bool {
	return now.Sub(x.Created) > maxAge+rotationJitter(x.ID, maxAge)
}

// rotate replaces the pool's aged proxies surge first, one at a time: with
// exactly size active proxies and one of them aged, it creates a
// replacement (the pool then holds size+1); with size+1 active and an aged
// one among them, it retires the oldest aged proxy once the pool has size
// ready proxies without it. It reports whether it took charge of the pool
// this round; otherwise the ordinary size reconciliation applies. A pool
// without maxAge never rotates.
func (p *Planner) rotate(ctx context.Context, r *round, pool Pool, active []Proxy, want int) bool {
	if pool.Spec.MaxAge <= 0 || pool.Deleted || want == 0 {
		return false
	}
	maxAge := time.Duration(pool.Spec.MaxAge)
	now := p.ageNow()
	var aged []Proxy
	ready := 0
	for _, x := range active {
		if x.State == events.ProxyReady {
			ready++
		}
		if isAged(x, maxAge, now) {
			aged = append(aged, x)
		}
	}
	if len(aged) == 0 {
		return false
	}
	sort.Slice(aged, func(i, j int) bool {
		if !aged[i].Created.Equal(aged[j].Created) {
			return aged[i].Created.Before(aged[j].Created)
		}
		return aged[i].ID < aged[j].ID
	})
	oldest := aged[0]
	switch len(active) {
	case want + 1:
		// A surge is under way: the replacement must be ready first.
		others := ready
		if oldest.State == events.ProxyReady {
			others--
		}
		if others >= want {
			p.retire(ctx, r, oldest, "rotated: older than maxAge "+maxAge.String())
		}
		return true
	case want:
		a, ok := p.place(r, pool)
		if !ok {
			p.log.Debug("no live target can take the replacement of an aged proxy now", "pool", pool.Name, "proxy", oldest.ID)
			return true
		}
		if p.create(ctx, r, pool, a, oldest.ID) {
			p.log.InfoContext(ctx, "rotating an aged proxy: replacement first", "pool", pool.Name, "proxy", oldest.ID,
				"age", now.Sub(oldest.Created).Round(time.Second).String(), "maxAge", maxAge.String())
		}
		return true
	}
	return false
}
