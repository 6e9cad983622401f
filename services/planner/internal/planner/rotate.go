package planner

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"sort"
	"strings"
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

// isAged reports whether proxy x, requested at x.CreatedAt, is older than
// maxAge plus its jitter at now.
func isAged(x Proxy, maxAge time.Duration, now time.Time) bool {
	return now.Sub(x.CreatedAt) > maxAge+rotationJitter(x.ID, maxAge)
}

// Retiring reasons of rolled and rotated proxies start with these; a
// condemned proxy whose replacement carries one holds the pool's one surge
// slot.
const (
	rolledPrefix  = "rolled: "
	rotatedPrefix = "rotated: "
)

// holdsSurge reports whether a replacement requested for reason is a roll or
// rotation step.
func holdsSurge(reason string) bool {
	return strings.HasPrefix(reason, rolledPrefix) || strings.HasPrefix(reason, rotatedPrefix)
}

// rotate replaces the pool's outdated proxies (requested before the last
// change of the pool's instance shape) and, with maxAge, its aged ones,
// surge first and one at a time: outdated before aged, unhealthy before
// healthy, oldest first. It requests a replacement naming the proxy it
// replaces; that proxy is then condemned (it no longer counts toward size)
// and is retired once its replacement is ready (see retireCondemned). Only
// one roll or rotation replacement is in flight per pool; sick proxies'
// replacements do not take that slot, and a sick member never holds a roll
// up, since it does not count. Rotation waits while the pool is not at size.
func (p *Planner) rotate(ctx context.Context, r *round, f *flight, pool Pool, pr *poolRound, want int) {
	maxAge := time.Duration(pool.Spec.MaxAge)
	now := p.ageNow()
	var outdated, aged []Proxy
	for _, x := range pr.counted {
		switch {
		case pool.isOutdated(x):
			outdated = append(outdated, x)
		case maxAge > 0 && isAged(x, maxAge, now):
			aged = append(aged, x)
		}
	}
	if len(outdated) == 0 && len(aged) == 0 || len(pr.counted) != want {
		return
	}
	for _, x := range pr.condemned {
		if holdsSurge(x.ReplaceReason) {
			return
		}
	}
	sickFirst(outdated)
	sickFirst(aged)
	next, why := Proxy{}, ""
	if len(outdated) > 0 {
		next, why = outdated[0], fmt.Sprintf("%sspec revision %d", rolledPrefix, pool.ShapeRevision)
	} else {
		next, why = aged[0], rotatedPrefix+"older than maxAge "+maxAge.String()
	}
	a, ok := p.place(r, pool)
	if !ok {
		p.noPlace(r, pool, pr, 1)
		return
	}
	if miss := p.create(ctx, r, f, pool, a, next.ID, why); miss != nil {
		pr.miss = miss
	} else {
		p.log.InfoContext(ctx, "replacing a proxy: replacement first", "pool", pool.Name, "proxy", next.ID,
			"why", why, "age", now.Sub(next.CreatedAt).Round(time.Second).String(),
			"proxyRevision", next.Revision, "shapeRevision", pool.ShapeRevision)
	}
}

// sickFirst orders proxies unhealthy first, then by creation, then id.
func sickFirst(xs []Proxy) {
	sort.SliceStable(xs, func(i, j int) bool {
		ui, uj := xs[i].State == events.ProxyUnhealthy, xs[j].State == events.ProxyUnhealthy
		if ui != uj {
			return ui
		}
		if !xs[i].CreatedAt.Equal(xs[j].CreatedAt) {
			return xs[i].CreatedAt.Before(xs[j].CreatedAt)
		}
		return xs[i].ID < xs[j].ID
	})
}
