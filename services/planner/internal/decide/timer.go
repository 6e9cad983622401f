package decide

import (
	"time"

	"proxyfleet/pkg/events"
)

// When says when a round must look at a pool again although no event
// touched it: Retry at once (a proxy it needs could not be placed, a
// spread value is short of its share with no target to take it, or a
// decision was not stored), at Due on the wall clock (a create, provision,
// ready or retire timeout), or at AgeDue on the clock proxy ages are
// measured with (an unhealthy proxy turning sick, a proxy reaching
// maxAge). The zero When: only when an event touches it.
type When struct {
	Retry       bool
	Due, AgeDue time.Time
}

// Timer says when a round must look at pool again although no event
// touches it: at once when retry; at the first create, provision, ready
// or retire timeout of its members (no ready timeout while health is
// down, see [ReadyDeadline]); when an unhealthy member turns sick
// (unhealthyAfter) or is retired regardless (twice that), and when a
// member reaches maxAge (plus its jitter). What waits on an event (a
// replacement getting ready, a rotation's turn) is looked at when the
// event arrives.
func Timer(cfg Config, pool *Pool, members []Proxy, h Health, retry bool, ageNow time.Time) When {
	t := When{Retry: retry}
	earliest := func(at *time.Time, when time.Time) {
		if at.IsZero() || when.Before(*at) {
			*at = when
		}
	}
	// ahead keeps an age-clock time only while it is still to come.
	ahead := func(when time.Time) {
		if when.After(ageNow) {
			earliest(&t.AgeDue, when)
		}
	}
	after := pool.Spec.UnhealthyAfterOrDefault()
	maxAge := time.Duration(pool.Spec.MaxAge)
	for _, x := range members {
		switch x.State {
		case events.ProxyRequested:
			earliest(&t.Due, x.UpdatedAt.Add(cfg.CreateTimeout))
		case events.ProxyProvisioning:
			earliest(&t.Due, x.UpdatedAt.Add(cfg.ProvisionTimeout))
		case events.ProxyRunning:
			if due, ok := ReadyDeadline(cfg, h, x); ok {
				earliest(&t.Due, due)
			}
		case events.ProxyRetiring:
			if !x.SkipCleanup {
				earliest(&t.Due, x.UpdatedAt.Add(cfg.RetireTimeout))
			}
		case events.ProxyUnhealthy:
			if !x.UnhealthySince.IsZero() {
				ahead(x.UnhealthySince.Add(after))
				ahead(x.UnhealthySince.Add(2 * after))
			}
		}
		if maxAge > 0 && IsActive(x.State) {
			ahead(x.CreatedAt.Add(maxAge + RotationJitter(x.ID, maxAge) + time.Nanosecond))
		}
	}
	return t
}

// IsDue reports whether a round at now (wall) and ageNow (age clock) must
// look at the pool.
func (t When) IsDue(now, ageNow time.Time) bool {
	return t.Retry || !t.Due.IsZero() && !now.Before(t.Due) || !t.AgeDue.IsZero() && !ageNow.Before(t.AgeDue)
}
