package decide

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"sort"
	"strings"
	"time"

	"proxyfleet/pkg/events"
)

// RotationJitter is the extra age, up to a tenth of maxAge, a proxy may
// reach before it is rotated. It is derived from the proxy id alone, so
// every replica computes the same value and a restart does not re-roll it;
// it spreads the rotation of proxies created together.
func RotationJitter(id string, maxAge time.Duration) time.Duration {
	span := maxAge / 10
	if span <= 0 {
		return 0
	}
	sum := sha256.Sum256([]byte(id))
	return time.Duration(binary.BigEndian.Uint64(sum[:8]) % uint64(span+1))
}

// IsAged reports whether proxy x, requested at x.CreatedAt, is older than
// maxAge plus its jitter at now.
func IsAged(x Proxy, maxAge time.Duration, now time.Time) bool {
	return now.Sub(x.CreatedAt) > maxAge+RotationJitter(x.ID, maxAge)
}

// Retiring reasons of rolled and rotated proxies start with these; a
// condemned proxy whose replacement carries one holds the pool's one surge
// slot.
const (
	RolledPrefix  = "rolled: "
	RotatedPrefix = "rotated: "
)

// HoldsSurge reports whether a replacement requested for reason is a roll,
// rotation or rebalance step ([RebalancePrefix]): a roll waits for a
// rebalance in flight, as a rebalance waits for a roll.
func HoldsSurge(reason string) bool {
	return strings.HasPrefix(reason, RolledPrefix) || strings.HasPrefix(reason, RotatedPrefix) || strings.HasPrefix(reason, RebalancePrefix)
}

// rotate replaces the pool's outdated proxies (requested before the last
// change of the pool's instance shape) and, with maxAge, its aged ones,
// surge first and one at a time: outdated before aged, unhealthy before
// healthy, oldest first. It requests a replacement naming the proxy it
// replaces; that proxy is then condemned (it no longer counts toward size)
// and is retired once its replacement is ready. Only one roll or rotation
// replacement is in flight per pool; sick proxies' replacements do not
// take that slot, and a sick member never holds a roll up, since it does
// not count. Rotation waits while the pool is not at size.
func (c *pass) rotate() {
	pool := &c.in.Pool
	maxAge := time.Duration(pool.Spec.MaxAge)
	now := c.in.AgeNow
	var outdated, aged []Proxy
	for _, x := range c.found.Counted {
		switch {
		case pool.IsOutdated(x):
			outdated = append(outdated, x)
		case maxAge > 0 && IsAged(x, maxAge, now):
			aged = append(aged, x)
		}
	}
	if len(outdated) == 0 && len(aged) == 0 || len(c.found.Counted) != c.want {
		return
	}
	for _, x := range c.found.Condemned {
		if HoldsSurge(x.ReplaceReason) {
			return
		}
	}
	SickFirst(outdated)
	SickFirst(aged)
	next, why := Proxy{}, ""
	if len(outdated) > 0 {
		next, why = outdated[0], fmt.Sprintf("%sspec revision %d", RolledPrefix, pool.ShapeRevision)
	} else {
		next, why = aged[0], RotatedPrefix+"older than maxAge "+maxAge.String()
	}
	if c.create(next, why, 1) {
		c.plan.Decisions[len(c.plan.Decisions)-1].Note = "replacing a proxy: replacement first"
	}
}

// SickFirst orders proxies unhealthy first, then by creation, then id.
func SickFirst(xs []Proxy) {
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
