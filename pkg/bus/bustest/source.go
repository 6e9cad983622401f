package bustest

import "proxyfleet/pkg/events"

// Agent entry and target named by [Source] for observations of an agent.
const (
	AgentEntry  = "local"
	AgentTarget = "t1"
)

// Source returns the CloudEvents source a test harness appends an event of
// typ to aggregate with, as the real writer would: readers skip events from
// a writer not allowed to append their type (see [events.CheckEvent]). The
// planner is preferred where it may write the type (failed), and agents are
// named by [AgentEntry] and [AgentTarget]. Unknown types get the planner's
// source.
func Source(aggregate, typ string) string {
	ws := events.Writers(aggregate, typ)
	if len(ws) == 0 {
		return events.SourcePlanner
	}
	switch ws[0] {
	case events.WriterAgent:
		return events.AgentSource(AgentEntry, AgentTarget)
	case events.WriterHealth:
		return events.SourceHealth
	}
	return events.SourcePlanner
}
