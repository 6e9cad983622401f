package planner

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
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

// rotate replaces the pool's outdated proxies (requested before the last
// change of the pool's instance shape) and, with maxAge, its aged ones,
// surge first and one at a time; outdated proxies go before aged ones and
// both share the one surge slot. With exactly size active proxies and a
// candidate among them, it creates a replacement with the current spec (the
// pool then holds size+1); with size+1 active and a candidate among them, it
// retires the first candidate once the pool has size ready proxies without
// it. It reports whether it took charge of the pool this round; otherwise
// the ordinary size reconciliation applies.
func (p *Planner) rotate(ctx context.Context, r *round, pool Pool, active []Proxy, want int) bool {
	if pool.Deleted || want == 0 {
		return false
	}
	maxAge := time.Duration(pool.Spec.MaxAge)
	now := p.ageNow()
	var outdated, aged []Proxy
	ready := 0
	for _, x := range active {
		if x.State == events.ProxyReady {
			ready++
		}
		switch {
		case pool.isOutdated(x):
			outdated = append(outdated, x)
		case maxAge > 0 && isAged(x, maxAge, now):
			aged = append(aged, x)
		}
	}
	if len(outdated) == 0 && len(aged) == 0 {
		return false
	}
	oldestFirst(outdated)
	oldestFirst(aged)
	next, why := Proxy{}, ""
	if len(outdated) > 0 {
		next, why = outdated[0], fmt.Sprintf("rolled: spec revision %d", pool.ShapeRevision)
	} else {
		next, why = aged[0], "rotated: older than maxAge "+maxAge.String()
	}
	switch len(active) {
	case want + 1:
		// A surge is under way: the replacement must be ready first.
		others := ready
		if next.State == events.ProxyReady {
			others--
		}
		if others >= want {
			p.retire(ctx, r, next, why)
		}
		return true
	case want:
		a, ok := p.place(r, pool)
		if !ok {
			p.log.Debug("no live target can take a replacement now", "pool", pool.Name, "proxy", next.ID, "why", why)
			return true
		}
		if p.create(ctx, r, pool, a, next.ID) {
			p.log.InfoContext(ctx, "replacing a proxy: replacement first", "pool", pool.Name, "proxy", next.ID,
				"why", why, "age", now.Sub(next.Created).Round(time.Second).String(),
				"proxyRevision", next.Revision, "shapeRevision", pool.ShapeRevision)
		}
		return true
	}
	return false
}

// oldestFirst orders proxies by creation, then id.
func oldestFirst(xs []Proxy) {
	sort.Slice(xs, func(i, j int) bool {
		if !xs[i].Created.Equal(xs[j].Created) {
			return xs[i].Created.Before(xs[j].Created)
		}
		return xs[i].ID < xs[j].ID
	})
}
