package decide

import (
	"time"

	"proxyfleet/pkg/events"
)

// Health is what the planner knows of the health service, whose probes
// alone turn a running proxy ready. "Health down" is not "proxies down":
// while no health replica is alive nobody probes, so a proxy's staying
// running says nothing about it.
type Health struct {
	// Down is true while no health replica is alive (the planner waits
	// one membership TTL after its start before it says so). Meanwhile
	// every pool's readiness is unknown and no running proxy is failed
	// for want of a passed probe.
	Down bool
	// Since is, while Down, when health was last seen alive (or when the
	// planner started watching, if it never saw a replica).
	Since time.Time
	// Back is when health last came back after being down; zero when it
	// was not down since the planner started. A running proxy's ready
	// timeout counts from Back at the earliest, so the proxies that were
	// running through the outage are not all failed the moment it ends.
	Back time.Time
}

// ReadyDeadline is when running member x fails for never getting ready:
// ReadyTimeout after it started running, or after health came back if
// that is later. ok is false while health is down: no deadline runs.
func ReadyDeadline(cfg Config, h Health, x Proxy) (at time.Time, ok bool) {
	if h.Down {
		return time.Time{}, false
	}
	from := x.UpdatedAt
	if h.Back.After(from) {
		from = h.Back
	}
	return from.Add(cfg.ReadyTimeout), true
}

// healthUnavailable is the Ready condition while health is down.
func healthUnavailable(since time.Time) events.PoolConditionData {
	return events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionUnknown, Reason: events.ReasonHealthUnavailable,
		Message: "no health replica is alive since " + since.UTC().Format(time.RFC3339) +
			"; readiness unknown (no proxy is failed for want of a probe until health is back)"}
}
