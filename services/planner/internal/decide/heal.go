package decide

import (
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

// IsSick reports whether x has been unhealthy for at least after at now.
func IsSick(x Proxy, now time.Time, after time.Duration) bool {
	return x.State == events.ProxyUnhealthy && !x.UnhealthySince.IsZero() && now.Sub(x.UnhealthySince) >= after
}

// UnhealthyReason is the retiring reason of a sick proxy: its reason is
// the last probe error.
func UnhealthyReason(x Proxy) string {
	if x.Reason == "" {
		return "unhealthy"
	}
	return "unhealthy: " + Truncate(x.Reason, 160)
}

// Truncate cuts s to at most n bytes.
func Truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// Replacement returns the live proxy requested to replace x, if any:
// replacements holds the proxies members' ReplacedBy name, by id.
func Replacement(replacements map[string]Proxy, x Proxy) (Proxy, bool) {
	if x.ReplacedBy == "" {
		return Proxy{}, false
	}
	y, ok := replacements[x.ReplacedBy]
	if !ok || !IsActive(y.State) {
		return Proxy{}, false
	}
	return y, true
}

// retireCondemned decides the retirements of the pool's condemned proxies
// that may go: those whose replacement is ready, all of them once the
// counted members alone hold want ready proxies, and sick ones unhealthy
// for twice unhealthyAfter whatever became of their replacement.
func (c *pass) retireCondemned(now time.Time, after time.Duration) map[string]bool {
	ready := 0
	for _, x := range c.found.Counted {
		if x.State == events.ProxyReady {
			ready++
		}
	}
	retired := map[string]bool{}
	for _, x := range c.found.Condemned {
		// The replacement says why (rolled, rotated, recycled); a sick
		// proxy's reason carries its last probe error.
		why := x.ReplaceReason
		sick2 := IsSick(x, now, 2*after)
		switch {
		case x.State == events.ProxyUnhealthy && (sick2 || why == "" || strings.HasPrefix(why, "unhealthy")):
			why = UnhealthyReason(x)
		case why == "":
			why = "replaced"
		}
		y, replaced := Replacement(c.in.Replacements, x)
		d := Decision{Kind: Retire, Proxy: x, Reason: why}
		switch {
		case sick2:
			d.Note = "retiring a proxy unhealthy for twice unhealthyAfter; no replacement became ready"
		case replaced && y.State == events.ProxyReady:
		case ready >= c.want:
		default:
			continue
		}
		if replaced {
			// Caused by the request of the replacement (a recycle, a
			// roll): the retirement links to it.
			d.CausedBy = y.ID
		}
		c.retire(d)
		retired[x.ID] = true
	}
	return retired
}
