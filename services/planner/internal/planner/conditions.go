package planner

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// maxListed bounds the names a condition message lists.
const maxListed = 5

// updateConditions appends a condition event for each of the pool's
// conditions whose status, reason or message differs from what the log
// holds: conditions change on transitions only, never once per round. The
// changed ones go in one fenced batch expecting the pool's last sequence;
// a conflict (the pool changed meanwhile) leaves them to the next round.
func (p *Planner) updateConditions(ctx context.Context, f *flight, pool Pool, want int, pr *poolRound) {
	var ds []bus.Decision
	var changed []events.PoolConditionData
	for _, d := range p.conditionsOf(pool, want, pr) {
		if cur, ok := events.FindCondition(pool.Conditions, d.Type); ok &&
			cur.Status == d.Status && cur.Reason == d.Reason && cur.Message == d.Message {
			continue
		}
		ds = append(ds, bus.Decision{Type: events.PoolCondition, MsgID: decisionID(pool.Name, events.PoolCondition, pool.LastSeq, d), Data: d})
		changed = append(changed, d)
	}
	if len(ds) == 0 {
		return
	}
	f.decide(ctx, nil, pool.Name, events.AggregatePool, pool.Name, &bus.Expect{Seq: pool.LastSeq}, ds,
		[]any{"pool", pool.Name, "decision", events.PoolCondition, "conditions", len(ds)},
		func(ctx context.Context, _ uint64) {
			for _, d := range changed {
				p.log.InfoContext(ctx, "pool condition", "pool", pool.Name, "type", d.Type, "status", d.Status, "reason", d.Reason, "message", d.Message)
			}
		})
}

// conditionsOf computes the pool's conditions from one round's findings.
func (p *Planner) conditionsOf(pool Pool, want int, pr *poolRound) []events.PoolConditionData {
	ready := events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady,
		Message: fmt.Sprintf("%d of %d proxies ready", want, want)}
	if pr.ready < want {
		ready.Status, ready.Reason = events.ConditionFalse, events.ReasonNotEnoughReady
		ready.Message = fmt.Sprintf("fewer than %d proxies ready", want)
	}

	placed := events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced,
		Message: "every proxy the pool needs has a target"}
	if pr.miss != nil {
		placed.Status, placed.Reason, placed.Message = events.ConditionFalse, pr.miss.reason, pr.miss.message
	}

	progressing := events.PoolConditionData{Type: events.ConditionProgressing, Status: events.ConditionFalse, Reason: events.ReasonSettled,
		Message: "the pool matches its spec"}
	maxAge := time.Duration(pool.Spec.MaxAge)
	now := p.ageNow()
	outdated, aged, pending := 0, 0, 0
	for _, x := range pr.counted {
		switch {
		case pool.isOutdated(x):
			outdated++
		case maxAge > 0 && isAged(x, maxAge, now):
			aged++
		}
		switch x.State {
		case events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning:
			pending++
		}
	}
	for _, x := range pr.condemned {
		if pool.isOutdated(x) {
			outdated++
		}
	}
	set := func(reason, msg string) {
		progressing.Status, progressing.Reason, progressing.Message = events.ConditionTrue, reason, msg
	}
	switch {
	case outdated > 0:
		set(events.ReasonRolling, fmt.Sprintf("rolling to spec revision %d", pool.ShapeRevision))
	case len(pr.condemned) > 0:
		ids := make([]string, 0, len(pr.condemned))
		for _, x := range pr.condemned {
			ids = append(ids, x.ID)
		}
		set(events.ReasonReplacing, "replacing "+joinNames(ids))
	case aged > 0:
		set(events.ReasonRotating, "rotating proxies older than maxAge "+maxAge.String())
	case want == 0 && pr.active > 0, want > 0 && (len(pr.counted) != want || pending > 0):
		set(events.ReasonScaling, fmt.Sprintf("scaling to %d proxies", want))
	}
	return []events.PoolConditionData{ready, placed, progressing}
}

// placeWhy explains why [Planner.place] found no target for a proxy of
// pool, naming the targets it considered.
func (p *Planner) placeWhy(r *round, pool Pool) placeMiss {
	entry := pool.Spec.Provider
	var live []agentSeen
	for _, a := range r.agents {
		if eligible(pool, a) {
			live = append(live, a)
		}
	}
	if len(live) == 0 {
		considered := pool.Spec.Targets
		if len(considered) == 0 {
			p.mu.Lock()
			known, _ := p.knownTargetsLocked(entry)
			p.mu.Unlock()
			considered = slices.Sorted(maps.Keys(known))
		}
		msg := fmt.Sprintf("no live agent of entry %s", entry)
		if len(considered) > 0 {
			msg += "; targets considered, none alive: " + joinNames(considered)
		} else {
			msg += "; no agent of this entry ever announced itself"
		}
		return placeMiss{reason: events.ReasonNoLiveTarget, message: msg}
	}
	if img := pool.Spec.Image; img != "" {
		of := func(a agentSeen) []string { return a.Images }
		l := offering(live, img, of)
		if len(l) == 0 {
			return placeMiss{reason: events.ReasonNoTargetOffersImage,
				message: fmt.Sprintf("no live target of entry %s offers image %s; considered: %s", entry, img, describe(live, of))}
		}
		live = l
	}
	if prof := pool.Spec.Profile; prof != "" {
		of := func(a agentSeen) []string { return a.Profiles }
		l := offering(live, prof, of)
		if len(l) == 0 {
			return placeMiss{reason: events.ReasonNoTargetOffersProfile,
				message: fmt.Sprintf("no live target of entry %s offers profile %s (with the pool's image); considered: %s", entry, prof, describe(live, of))}
		}
		live = l
	}
	var roomy []agentSeen
	var full []string
	for _, a := range live {
		k := targetKey(a.Entry, a.Target)
		if a.Capacity > 0 && r.onTarget[k] >= a.Capacity {
			full = append(full, fmt.Sprintf("%s (%d of %d)", a.Target, r.onTarget[k], a.Capacity))
			continue
		}
		roomy = append(roomy, a)
	}
	if len(roomy) == 0 {
		return placeMiss{reason: events.ReasonCapacityExhausted,
			message: "every live target that offers the pool's image and profile is full: " + joinNames(full)}
	}
	reason := events.ReasonTargetsFailing
	var avoided []string
	for _, a := range roomy {
		av := r.avoid[targetKey(a.Entry, a.Target)]
		if av.class == events.ClassQuota {
			reason = events.ReasonQuota
		}
		avoided = append(avoided, fmt.Sprintf("%s (%s at %s, avoided until %s)", a.Target, av.class,
			av.at.UTC().Format(time.RFC3339), av.at.Add(p.cfg.QuotaAvoid).UTC().Format(time.RFC3339)))
	}
	sort.Strings(avoided)
	return placeMiss{reason: reason, message: "every remaining target failed recently: " + joinNames(avoided)}
}

// offering returns the targets whose list (of) holds want.
func offering(targets []agentSeen, want string, of func(agentSeen) []string) []agentSeen {
	var out []agentSeen
	for _, a := range targets {
		if slices.Contains(of(a), want) {
			out = append(out, a)
		}
	}
	return out
}

// describe names each target with what of says it offers.
func describe(targets []agentSeen, of func(agentSeen) []string) string {
	parts := make([]string, 0, len(targets))
	for _, a := range targets {
		have := "nothing"
		if l := of(a); len(l) > 0 {
			have = strings.Join(l, ", ")
		}
		parts = append(parts, a.Target+" (offers "+have+")")
	}
	return joinNames(parts)
}

// joinNames joins names, at most maxListed of them.
func joinNames(names []string) string {
	if len(names) <= maxListed {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:maxListed], ", ") + fmt.Sprintf(" and %d more", len(names)-maxListed)
}
