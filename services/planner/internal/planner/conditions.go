package planner

import (
	"context"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// updateConditions appends the pool's changed conditions (see
// [decide.Changed]) in one fenced batch expecting the pool's last
// sequence; a conflict (the pool changed meanwhile) leaves them to the
// next round.
func (rc *reconciler) updateConditions(ctx context.Context, f *flight, pool Pool, changed []events.PoolConditionData) {
	if len(changed) == 0 {
		return
	}
	ds := make([]bus.Decision, 0, len(changed))
	for _, d := range changed {
		ds = append(ds, bus.Decision{Type: events.PoolCondition, MsgID: decisionID(pool.Name, events.PoolCondition, pool.LastSeq, d), Data: d})
	}
	f.decide(ctx, nil, pool.Name, events.AggregatePool, pool.Name, &bus.Expect{Seq: pool.LastSeq}, ds,
		[]any{"pool", pool.Name, "decision", events.PoolCondition, "conditions", len(ds)},
		func(ctx context.Context, _ uint64) {
			for _, d := range changed {
				rc.log.InfoContext(ctx, "pool condition", "pool", pool.Name, "type", d.Type, "status", d.Status, "reason", d.Reason, "message", d.Message)
			}
		})
}
