package events

import "strings"

// Subject prefixes. Services never concatenate subjects themselves; they call
// the functions below.
const (
	apiPrefix     = "fleet.api."
	agentPrefix   = "fleet.agent."
	gatewayPrefix = "fleet.gateway."
	cmdPrefix     = "fleet.cmd."
	evtPrefix     = "fleet.evt."
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

// Gateway request endpoints.
const (
	GatewayInfo  = "info"
	GatewayStats = "stats"
	// GatewayCA answers the PEM of the fleet's gateway CA, the
	// certificate clients of intercepting pools trust.
	GatewayCA = "ca"
)

// GatewaySubject returns "fleet.gateway.<name>.<endpoint>", e.g.
// "fleet.gateway.gw1.info": an endpoint of one gateway (endpoint is info,
// stats or ca).
func GatewaySubject(name, endpoint string) string { return GatewayGroup(name) + "." + endpoint }

// GatewayLogSubject returns "fleet.gateway.log.<name>", where gateway
// name publishes its request log ([GatewayRequest]). "log" is therefore
// no gateway's name ([GatewayLogToken]).
func GatewayLogSubject(name string) string { return gatewayPrefix + GatewayLogToken + "." + name }

// GatewayLogToken is the token after "fleet.gateway." of the request log's
// subjects; a gateway named so would answer on them.
const GatewayLogToken = "log"

// GatewayLogAll is "fleet.gateway.log.*", the subjects of the gateways'
// request log stream (FLEET_GATEWAY_LOG).
const GatewayLogAll = gatewayPrefix + GatewayLogToken + ".*"

// GatewayGroup returns "fleet.gateway.<name>", the micro service group of
// one gateway.
func GatewayGroup(name string) string { return gatewayPrefix + name }

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
// "fleet.evt.proxy.demo-abc.retiring": the subject of the planner's
// decisions and of the health service's observations. An agent's
// observations are on [ObservationSubject] instead.
func EventSubject(aggregate, id, typ string) string {
	return evtPrefix + aggregate + "." + id + "." + typ
}

// ObservationSubject returns "fleet.evt.proxy.<id>.<type>.<entry>.<target>",
// e.g. "fleet.evt.proxy.demo-abc.running.local.t1": the subject of an
// observation (provisioning, running, failed, deleted) of proxy id by the
// agent serving entry/target. The agent's name is in the subject so that
// the server, not the event's data, decides who may write it: agent
// local/t1 may publish only on "fleet.evt.proxy.*.<type>.local.t1", and
// readers refuse an observation whose subject names another agent than
// the one the proxy was placed on.
func ObservationSubject(id, typ, entry, target string) string {
	return evtPrefix + AggregateProxy + "." + id + "." + typ + "." + entry + "." + target
}

// ObservationFilter returns "fleet.evt.proxy.<id>.<type>.>", the
// observations of type typ of proxy id by any agent.
func ObservationFilter(id, typ string) string {
	return evtPrefix + AggregateProxy + "." + id + "." + typ + ".>"
}

// DecisionFilter returns "fleet.evt.<aggregate>.<id>.*", the events of one
// aggregate that no agent observed: the planner's decisions and the health
// service's observations.
func DecisionFilter(aggregate, id string) string {
	return evtPrefix + aggregate + "." + id + ".*"
}

// AgentFilter returns "fleet.evt.proxy.<id>.*.<entry>.<target>", the
// observations of proxy id by the agent serving entry/target.
func AgentFilter(id, entry, target string) string {
	return evtPrefix + AggregateProxy + "." + id + ".*." + entry + "." + target
}

// SubjectOf returns the subject the writer named by source appends an
// event of type typ of aggregate/id on: [ObservationSubject] for a proxy
// event of an agent (source [AgentSource]), [EventSubject] otherwise.
func SubjectOf(source, aggregate, id, typ string) string {
	if by, ok := ParseAgentSource(source); ok && aggregate == AggregateProxy {
		return ObservationSubject(id, typ, by.Entry, by.Target)
	}
	return EventSubject(aggregate, id, typ)
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

// Observer is the agent an observation's subject names (see
// [ObservationSubject]); zero for an event on an [EventSubject].
type Observer struct {
	Entry, Target string
}

// IsZero reports whether o names no agent.
func (o Observer) IsZero() bool { return o == Observer{} }

// Source is the CloudEvents source of o's events, [AgentSource].
func (o Observer) Source() string { return AgentSource(o.Entry, o.Target) }

// String is "<entry>/<target>".
func (o Observer) String() string { return o.Entry + "/" + o.Target }

// ParseEventSubject splits "fleet.evt.<aggregate>.<id>.<type>" (by is
// zero) and "fleet.evt.proxy.<id>.<type>.<entry>.<target>" (by names the
// agent). ok is false for any other shape, including five tokens on an
// aggregate other than proxy. The tokens are not checked against the
// identifier rule: [CheckEvent] does that.
func ParseEventSubject(subject string) (aggregate, id, typ string, by Observer, ok bool) {
	rest, found := strings.CutPrefix(subject, evtPrefix)
	if !found {
		return "", "", "", Observer{}, false
	}
	parts := strings.Split(rest, ".")
	for _, p := range parts {
		if p == "" {
			return "", "", "", Observer{}, false
		}
	}
	switch {
	case len(parts) == 3:
	case len(parts) == 5 && parts[0] == AggregateProxy:
		by = Observer{Entry: parts[3], Target: parts[4]}
	default:
		return "", "", "", Observer{}, false
	}
	return parts[0], parts[1], parts[2], by, true
}
