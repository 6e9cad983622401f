package planner

import (
	"context"
	"strings"
	"time"

	"proxyfleet/pkg/events"
)

// How the fleet heals (see docs/operator-guide.md, "Replacement"):
//
//   - A proxy unhealthy for longer than its pool's unhealthyAfter is sick.
//     It stops counting toward the pool's size, so the next round requests
//     a replacement naming it (surge: the pool holds one more proxy while
//     it happens). The sick proxy is retired, with reason
//     "unhealthy: <last probe error>", as soon as its replacement is ready,
//     or once it has been unhealthy for twice unhealthyAfter if no
//     replacement became ready meanwhile. A proxy that recovers before
//     unhealthyAfter is kept.
//   - A proxy whose replacement is live (requested by a roll, a rotation,
//     a recycle or the rule above) is condemned the same way: it keeps
//     serving until its replacement is ready.
//   - A failed proxy is retired at once and does not count, so it is
//     replaced by the ordinary fill.
//
// Every input is in the event log: when a proxy became unhealthy is the
// time of the health service's event, and which proxy replaces which is in
// the requested event. A new leader decides the same.

// isSick reports whether x has been unhealthy for at least after at now.
func isSick(x Proxy, now time.Time, after time.Duration) bool {
	return x.State == events.ProxyUnhealthy && !x.UnhealthySince.IsZero() && now.Sub(x.UnhealthySince) >= after
}

// unhealthyReason is the retiring reason of a sick proxy: its reason is
// the last probe error.
func unhealthyReason(x Proxy) string {
	if x.Reason == "" {
		return "unhealthy"
	}
	return "unhealthy: " + truncate(x.Reason, 160)
}

// replacement returns the live proxy requested to replace x, if any.
func (r *round) replacement(x Proxy) (Proxy, bool) {
	if x.ReplacedBy == "" {
		return Proxy{}, false
	}
	y, ok := r.byID[x.ReplacedBy]
	if !ok || !isActive(y.State) {
		return Proxy{}, false
	}
	return y, true
}

// retireCondemned retires the pool's condemned proxies that may go: those
// whose replacement is ready, all of them once the counted members alone
// hold want ready proxies, and sick ones unhealthy for twice unhealthyAfter
// whatever became of their replacement. It returns the ids it retired.
func (p *Planner) retireCondemned(ctx context.Context, r *round, f *flight, pool Pool, pr *poolRound, want int, now time.Time, after time.Duration) map[string]bool {
	ready := 0
	for _, x := range pr.counted {
		if x.State == events.ProxyReady {
			ready++
		}
	}
	retired := map[string]bool{}
	for _, x := range pr.condemned {
		// The replacement says why (rolled, rotated, recycled); a sick
		// proxy's reason carries its last probe error.
		why := x.ReplaceReason
		sick2 := isSick(x, now, 2*after)
		switch {
		case x.State == events.ProxyUnhealthy && (sick2 || why == "" || strings.HasPrefix(why, "unhealthy")):
			why = unhealthyReason(x)
		case why == "":
			why = "replaced"
		}
		y, replaced := r.replacement(x)
		switch {
		case sick2:
			p.log.InfoContext(ctx, "retiring a proxy unhealthy for twice unhealthyAfter; no replacement became ready",
				"pool", pool.Name, "proxy", x.ID, "unhealthySince", x.UnhealthySince, "unhealthyAfter", after.String())
		case replaced && y.State == events.ProxyReady:
		case ready >= want:
		default:
			continue
		}
		rctx := ctx
		if replaced && y.traceparent != "" {
			// Caused by the request of the replacement (a recycle, a
			// roll): the retirement links to it.
			rctx = causedBy(ctx, y.traceparent)
		}
		p.retire(rctx, r, f, x, why, "")
		retired[x.ID] = true
	}
	return retired
}
