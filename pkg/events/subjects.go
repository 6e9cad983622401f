package events

import "strings"

// Subject prefixes. Services never concatenate subjects themselves; they call
// the functions below.
const (
	apiPrefix   = "fleet.api."
	agentPrefix = "fleet.agent."
	cmdPrefix   = "fleet.cmd."
	evtPrefix   = "fleet.evt."
)

// Aggregate kinds that appear in event subjects.
const (
	AggregatePool  = "pool"
	AggregateProxy = "proxy"
)

// Command verbs.
const (
	VerbCreate = "create"
	VerbDelete = "delete"
)

// Agent request verbs.
const (
	AgentInfo      = "info"
	AgentInventory = "inventory"
	AgentCheck     = "check"
)

// APISubject returns the operator API subject "fleet.api.<noun>.<verb>",
// e.g. "fleet.api.pool.apply".
func APISubject(noun, verb string) string { return apiPrefix + noun + "." + verb }

// APIGroup returns "fleet.api.<noun>", the micro service group of a noun.
func APIGroup(noun string) string { return apiPrefix + noun }

// AgentSubject returns "fleet.agent.<entry>.<target>.<verb>", the request
// subject an agent answers (verb is info, inventory or check).
func AgentSubject(entry, target, verb string) string {
	return AgentGroup(entry, target) + "." + verb
}

// AgentGroup returns "fleet.agent.<entry>.<target>", the micro service group
// of one agent.
func AgentGroup(entry, target string) string { return agentPrefix + entry + "." + target }

// CommandSubject returns "fleet.cmd.<entry>.<target>.<verb>", where the
// planner publishes a backend command (verb is create or delete).
func CommandSubject(entry, target, verb string) string {
	return cmdPrefix + entry + "." + target + "." + verb
}

// CommandFilter returns "fleet.cmd.<entry>.<target>.>", the filter of the one
// durable consumer an agent owns.
func CommandFilter(entry, target string) string { return cmdPrefix + entry + "." + target + ".>" }

// CommandsAll is "fleet.cmd.>", the subjects of the FLEET_CMDS stream.
const CommandsAll = cmdPrefix + ">"

// EventSubject returns "fleet.evt.<aggregate>.<id>.<type>", e.g.
// "fleet.evt.proxy.demo-abc.running".
func EventSubject(aggregate, id, typ string) string {
	return evtPrefix + aggregate + "." + id + "." + typ
}

// AggregateFilter returns "fleet.evt.<aggregate>.<id>.>", every event of one
// aggregate. Optimistic concurrency checks use this wildcard, not one exact
// subject, so that two decisions of different types still conflict.
func AggregateFilter(aggregate, id string) string {
	return evtPrefix + aggregate + "." + id + ".>"
}

// EventsAll is "fleet.evt.>", the subjects of the FLEET_EVENTS stream.
const EventsAll = evtPrefix + ">"

// ProgressSubject returns "fleet.progress.<entry>.<target>", where agents
// publish core-NATS progress of long work (for example image downloads). It
// is not captured by any stream: progress is for watching, not for history.
func ProgressSubject(entry, target string) string { return "fleet.progress." + entry + "." + target }

// ParseEventSubject splits "fleet.evt.<aggregate>.<id>.<type>". ok is false
// for any other shape.
func ParseEventSubject(subject string) (aggregate, id, typ string, ok bool) {
	if len(subject) <= len(evtPrefix) || subject[:len(evtPrefix)] != evtPrefix {
		return "", "", "", false
	}
	parts := strings.Split(subject[len(evtPrefix):], ".")
	if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return "", "", "", false
	}
	return parts[0], parts[1], parts[2], true
}
