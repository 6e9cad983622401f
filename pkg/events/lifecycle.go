package events

import (
	"slices"
	"strings"
)

// Writers: the roles that append events, named by an event's CloudEvents
// source.
const (
	WriterPlanner = "planner"
	WriterAgent   = "agent"
	WriterHealth  = "health"
)

// CloudEvents sources of the writers.
const (
	// SourcePlanner is the source of every planner decision.
	SourcePlanner = "proxyfleet/planner"
	// SourceHealth is the source of the health service's observations.
	SourceHealth = "proxyfleet/health"

	agentSourcePrefix = "proxyfleet/agent/"
)

// AgentSource returns "proxyfleet/agent/<entry>/<target>", the source of the
// observations of the agent serving one target.
func AgentSource(entry, target string) string { return agentSourcePrefix + entry + "/" + target }

// ParseAgentSource returns the agent that source "proxyfleet/agent/<entry>/<target>"
// names, both names satisfying the identifier rule; ok is false for any
// other source.
func ParseAgentSource(source string) (by Observer, ok bool) {
	rest, ok := strings.CutPrefix(source, agentSourcePrefix)
	if !ok {
		return Observer{}, false
	}
	entry, target, ok := strings.Cut(rest, "/")
	if !ok || !IsIdentifier(entry) || !IsIdentifier(target) {
		return Observer{}, false
	}
	return Observer{Entry: entry, Target: target}, true
}

// WriterOf returns the role that source names: [WriterPlanner],
// [WriterAgent] (for "proxyfleet/agent/<entry>/<target>" with both names
// satisfying the identifier rule) or [WriterHealth]; "" for anything else.
func WriterOf(source string) string {
	switch source {
	case SourcePlanner:
		return WriterPlanner
	case SourceHealth:
		return WriterHealth
	}
	if _, ok := ParseAgentSource(source); ok {
		return WriterAgent
	}
	return ""
}

// writers lists, per event type, the roles allowed to append it. Types not
// listed here are not checked (a reader that does not know a type ignores
// it anyway).
var writers = map[string]map[string][]string{
	AggregateProxy: {
		ProxyRequested:    {WriterPlanner},
		ProxyProvisioning: {WriterAgent},
		ProxyRunning:      {WriterAgent},
		ProxyReady:        {WriterHealth},
		ProxyUnhealthy:    {WriterHealth},
		// Agents record what their backend refused or lost; the planner
		// records timeouts, dead letters and vanished instances.
		ProxyFailed:    {WriterPlanner, WriterAgent},
		ProxyRetiring:  {WriterPlanner},
		ProxyDeleted:   {WriterAgent},
		ProxyAbandoned: {WriterPlanner},
		ProxyDisabled:  {WriterPlanner},
	},
	AggregatePool: {
		PoolApplied:   {WriterPlanner},
		PoolDeleted:   {WriterPlanner},
		PoolCondition: {WriterPlanner},
		PoolScaled:    {WriterPlanner},
	},
}

// Writers returns the roles allowed to append events of type typ to an
// aggregate of kind aggregate, or nil when the type is not a known one.
func Writers(aggregate, typ string) []string { return writers[aggregate][typ] }

// CheckEvent reports whether an event read from the log may enter a
// reader's state: the id of a proxy or pool in its subject must satisfy the
// identifier rule, a known event type must come from one of its
// [Writers], and the subject must be the one its writer appends on (see
// [SubjectOf]): an agent's proxy event names that agent in its subject (by,
// from [ParseEventSubject], whose [Observer.Source] must be the event's
// source), and no other event names an agent. It returns a [*FieldError]
// naming "id", "source" or "subject" otherwise. Every reader of
// FLEET_EVENTS skips such events. Other aggregates are left to their
// readers. Whether the agent is the one the proxy was placed on is
// [CheckPlacement]'s question.
func CheckEvent(aggregate, id, typ, source string, by Observer) *FieldError {
	if aggregate != AggregateProxy && aggregate != AggregatePool {
		return nil
	}
	if fe := CheckIdentifier("id", id); fe != nil {
		return fe
	}
	w := WriterOf(source)
	if allowed := Writers(aggregate, typ); allowed != nil && !slices.Contains(allowed, w) {
		return &FieldError{Field: "source", Reason: "may not write " + aggregate + " " + typ + " events (writers: " + strings.Join(allowed, ", ") + ")", Value: source}
	}
	switch {
	case !by.IsZero() && (!IsIdentifier(by.Entry) || !IsIdentifier(by.Target)):
		return &FieldError{Field: "subject", Reason: "names an agent whose entry or target breaks the identifier rule", Value: by.String()}
	case !by.IsZero() && source != by.Source():
		return &FieldError{Field: "source", Reason: "differs from the agent the subject names (" + by.String() + ")", Value: source}
	case by.IsZero() && w == WriterAgent && aggregate == AggregateProxy:
		return &FieldError{Field: "subject", Reason: "an agent's observation must be on " + ObservationSubject("<id>", "<type>", "<entry>", "<target>") + ", not " + EventSubject(aggregate, "<id>", "<type>"), Value: EventSubject(aggregate, id, typ)}
	}
	return nil
}

// CheckPlacement reports whether the observation of agent by (the
// [Observer] of its subject; zero for an event that is no agent's) may
// enter the state of a proxy the planner placed on entry/target (those of
// its requested event): an agent speaks only for the proxies of its own
// entry and target. It returns a [*FieldError] naming "subject"
// otherwise; readers skip such events as they skip those [CheckEvent]
// refuses.
func CheckPlacement(by Observer, entry, target string) *FieldError {
	if by.IsZero() || (by.Entry == entry && by.Target == target) {
		return nil
	}
	return &FieldError{Field: "subject", Reason: "names agent " + by.String() + ", but the proxy was placed on " + entry + "/" + target, Value: by.String()}
}

// Transition is the proxy lifecycle: what event does to a proxy in state
// from. ok false means the event is ignored in that state: it changes
// nothing, neither the state nor any other recorded data. ok true means the
// event is applied: its data is recorded (addresses, provider ids,
// attempts, reasons) and the proxy is in state to afterwards, which may be
// from itself (a late provisioning or running on a failed or retiring proxy
// still records the provider id and address, so the delete finds the
// instance, but does not revive the proxy).
//
// from is "" for a proxy no event has created yet. The rules:
//   - only requested creates a proxy; a re-issued requested on a requested
//     proxy is a new attempt of the same create; in any other state it is a
//     stale decision and is ignored;
//   - while a proxy is active (requested, provisioning, running, ready,
//     unhealthy) every observation of progress moves it to that state
//     (provisioning after running is a new create attempt; ready ⇄
//     unhealthy), and failed, retiring, deleted and abandoned end it;
//   - failed and retiring are decisions: late observations never revive the
//     proxy (provisioning and running are recorded, ready and unhealthy
//     ignored); a second failure is ignored (the first one stands); a
//     retiring proxy does not fail (it is on its way out already); failed
//     goes to retiring, and both end in deleted or abandoned; a re-issued
//     retiring on a retiring proxy is a new delete attempt;
//   - deleted and abandoned are terminal and absorb every event;
//   - disabled (external proxies only) takes an active proxy out of
//     service; a re-issued disabled sets a new time; ready (health saw
//     the time pass and a probe succeed) returns it to service; failed,
//     retiring, deleted and abandoned end it; other observations are
//     ignored.
//
// Both the planner's fold and the health service's projection apply events
// through Transition, so they never disagree about a proxy's state.
func Transition(from, event string) (to string, ok bool) {
	if Writers(AggregateProxy, event) == nil {
		return from, false
	}
	switch from {
	case "":
		if event == ProxyRequested {
			return ProxyRequested, true
		}
	case ProxyRequested, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy:
		if event != ProxyRequested || from == ProxyRequested {
			return event, true
		}
	case ProxyDisabled:
		switch event {
		case ProxyDisabled, ProxyReady, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned:
			return event, true
		}
	case ProxyFailed, ProxyRetiring:
		switch event {
		case ProxyProvisioning, ProxyRunning:
			return from, true
		case ProxyRetiring, ProxyDeleted, ProxyAbandoned:
			return event, true
		}
	}
	return from, false
}

// CheckProxyData decodes and validates the data of a proxy event of type
// typ. Every reader skips a proxy event whose data does not decode, before
// [Transition], so a malformed fact moves no reader. Unknown types are not
// checked.
func CheckProxyData(typ string, e Envelope) error {
	var d any
	switch typ {
	case ProxyRequested:
		d = &ProxyRequestedData{}
	case ProxyProvisioning:
		d = &ProxyProvisioningData{}
	case ProxyRunning:
		d = &ProxyRunningData{}
	case ProxyReady:
		d = &ProxyReadyData{}
	case ProxyUnhealthy:
		d = &ProxyUnhealthyData{}
	case ProxyFailed:
		d = &ProxyFailedData{}
	case ProxyRetiring:
		d = &ProxyRetiringData{}
	case ProxyDeleted:
		d = &ProxyDeletedData{}
	case ProxyAbandoned:
		d = &ProxyAbandonedData{}
	case ProxyDisabled:
		d = &ProxyDisabledData{}
	default:
		return nil
	}
	return e.DecodeData(d)
}

// CheckPoolData decodes the data of a pool event of type typ. Every reader
// skips a pool event whose data does not decode, as the planner does, so
// that no reader acts on an event another refuses (a deleted pool whose
// deletion the planner cannot read stays in every view). Unknown types are
// not checked.
func CheckPoolData(typ string, e Envelope) error {
	var d any
	switch typ {
	case PoolApplied:
		d = &PoolAppliedData{}
	case PoolDeleted:
		d = &PoolDeletedData{}
	case PoolScaled:
		d = &PoolScaledData{}
	case PoolCondition:
		d = &PoolConditionData{}
	default:
		return nil
	}
	return e.DecodeData(d)
}

// ProxyStates returns the states of a proxy in lifecycle order (disabled,
// which only external proxies reach, last); they are also the proxy event
// types.
func ProxyStates() []string {
	return []string{
		ProxyRequested, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy,
		ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled,
	}
}
