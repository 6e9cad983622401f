package decide

import (
	"fmt"
	"time"

	"proxyfleet/pkg/events"
)

// Conditions are the pool's conditions after a pass that wanted want
// proxies and found f (with the writer's miss, if it refused a create):
// Ready, Placed and Progressing, in that order, then Cleanup once a
// delete of the pool's got stuck (and from then on). See
// docs/operator-guide.md, "Pool conditions".
func Conditions(pool *Pool, want int, f *Found, ageNow time.Time) []events.PoolConditionData {
	ready := events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady,
		Message: fmt.Sprintf("%d of %d proxies ready", want, want)}
	if f.Ready < want {
		ready.Status, ready.Reason = events.ConditionFalse, events.ReasonNotEnoughReady
		ready.Message = fmt.Sprintf("fewer than %d proxies ready", want)
	}
	if !f.HealthDownSince.IsZero() {
		// Nobody probes: ready and unhealthy are as old as the outage.
		ready = healthUnavailable(f.HealthDownSince)
	}

	placed := events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced,
		Message: "every proxy the pool needs has a target"}
	switch {
	case f.Miss != nil:
		placed.Status, placed.Reason, placed.Message = events.ConditionFalse, f.Miss.Reason, f.Miss.Message
	case f.SpreadShort != "":
		placed.Status, placed.Reason, placed.Message = events.ConditionFalse, events.ReasonSpreadUnmet, "spread: "+f.SpreadShort
	}

	progressing := events.PoolConditionData{Type: events.ConditionProgressing, Status: events.ConditionFalse, Reason: events.ReasonSettled,
		Message: "the pool matches its spec"}
	maxAge := time.Duration(pool.Spec.MaxAge)
	outdated, aged, pending := 0, 0, 0
	for _, x := range f.Counted {
		switch {
		case pool.IsOutdated(x):
			outdated++
		case maxAge > 0 && IsAged(x, maxAge, ageNow):
			aged++
		}
		switch x.State {
		case events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning:
			pending++
		}
	}
	for _, x := range f.Condemned {
		if pool.IsOutdated(x) {
			outdated++
		}
	}
	set := func(reason, msg string) {
		progressing.Status, progressing.Reason, progressing.Message = events.ConditionTrue, reason, msg
	}
	switch {
	case outdated > 0:
		set(events.ReasonRolling, fmt.Sprintf("rolling to spec revision %d", pool.ShapeRevision))
	case len(f.Condemned) > 0:
		ids := make([]string, 0, len(f.Condemned))
		for _, x := range f.Condemned {
			ids = append(ids, x.ID)
		}
		set(events.ReasonReplacing, "replacing "+JoinNames(ids))
	case aged > 0:
		set(events.ReasonRotating, "rotating proxies older than maxAge "+maxAge.String())
	case want == 0 && f.Active > 0, want > 0 && (len(f.Counted) != want || pending > 0):
		set(events.ReasonScaling, fmt.Sprintf("scaling to %d proxies", want))
	}
	out := []events.PoolConditionData{ready, placed, progressing}
	if c, ok := cleanup(pool, f); ok {
		out = append(out, c)
	}
	return out
}

// cleanup is the pool's Cleanup condition: False while deletes of its
// retired proxies are stuck, naming them, their targets, since when they
// retire and the last failure recorded; True once none is, for a pool
// that had it False. Pools whose deletes never got stuck do not carry it.
func cleanup(pool *Pool, f *Found) (events.PoolConditionData, bool) {
	if len(f.StuckDeletes) == 0 {
		if _, had := events.FindCondition(pool.Conditions, events.ConditionCleanup); !had {
			return events.PoolConditionData{}, false
		}
		return events.PoolConditionData{Type: events.ConditionCleanup, Status: events.ConditionTrue, Reason: events.ReasonCleanedUp,
			Message: "no delete of a retired proxy is stuck"}, true
	}
	parts := make([]string, 0, len(f.StuckDeletes))
	for _, x := range f.StuckDeletes {
		s := fmt.Sprintf("%s on %s/%s (retiring since %s", x.ID, x.Entry, x.Target, x.RetiringSince.UTC().Format(time.RFC3339))
		if x.DeleteFailure != "" {
			s += "; last failure: " + Truncate(x.DeleteFailure, 160)
		}
		parts = append(parts, s+")")
	}
	return events.PoolConditionData{Type: events.ConditionCleanup, Status: events.ConditionFalse, Reason: events.ReasonDeleteStuck,
		Message: "deletes keep failing, their instances may still run: " + JoinNames(parts)}, true
}

// Changed returns the conditions of cs whose status, reason or message
// differs from what the pool's log holds: conditions change on
// transitions only, never once per round.
func Changed(pool *Pool, cs []events.PoolConditionData) []events.PoolConditionData {
	var out []events.PoolConditionData
	for _, d := range cs {
		if cur, ok := events.FindCondition(pool.Conditions, d.Type); ok &&
			cur.Status == d.Status && cur.Reason == d.Reason && cur.Message == d.Message {
			continue
		}
		out = append(out, d)
	}
	return out
}
