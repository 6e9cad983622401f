// Package lifecycletest generates adversarial proxy event sequences for the
// tests of every reader that folds the proxy lifecycle (the planner's fold,
// health's projection), and says which state [events.Transition] gives each
// proxy after them. Feeding the same sequences to every reader and checking
// each against [Want] is what keeps the readers from disagreeing.
package lifecycletest

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"time"

	"proxyfleet/pkg/events"
)

// Event is one event of a sequence, appended as its Source would.
type Event struct {
	Aggregate string
	ID        string
	Kind      string
	Source    string
	MsgID     string
	Data      any
	// Subject is the subject the event is appended on when it is not
	// the one its Source writes on (a forged or misplaced observation);
	// "" otherwise. See [Event.On].
	Subject string
}

// On returns the subject e is appended on: Subject, or the one its Source
// writes on ([events.SubjectOf]).
func (e Event) On() string {
	if e.Subject != "" {
		return e.Subject
	}
	return events.SubjectOf(e.Source, e.Aggregate, e.ID, e.Kind)
}

// Other names an agent other than the one of [Entry] and [Target]: its
// observations of proxies placed on Entry/Target are refused.
const OtherTarget = "t2"

// Agent names the entry and target of the agent observations.
const (
	Entry  = "local"
	Target = "t1"
)

// Sequence returns n events over a handful of proxies whose ids start with
// prefix, drawn from seed: every type in any order, mostly from their
// writer and sometimes from the wrong one or with data that does not
// decode, some on ids that break the identifier rule, events before
// requested and after deleted, repeated requested and retiring. The same
// seed gives the same events.
func Sequence(prefix string, seed uint64, n int) []Event {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	ids := []string{prefix + "-a", prefix + "-b", prefix + "-c", "Bad_" + prefix}
	kinds := append(events.ProxyStates(), "exploded")
	out := make([]Event, 0, n)
	for i := range n {
		id := ids[r.IntN(len(ids))]
		kind := kinds[r.IntN(len(kinds))]
		source := writerSource(kind)
		if r.IntN(8) == 0 {
			source = []string{events.SourcePlanner, events.SourceHealth, events.AgentSource(Entry, Target), "test"}[r.IntN(4)]
		}
		e := Make(id, kind, source, i)
		if r.IntN(10) == 0 {
			e.Data = json.RawMessage(malformed)
		}
		out = append(out, e)
	}
	return out
}

// malformed is event data that decodes into no proxy event's data.
const malformed = `[]`

// Make returns event number i of a sequence: kind on proxy id, from source,
// with valid data.
func Make(id, kind, source string, i int) Event {
	return Event{
		Aggregate: events.AggregateProxy, ID: id, Kind: kind, Source: source,
		MsgID: fmt.Sprintf("%s.%s.%d", id, kind, i+1), Data: data(id, kind, i),
	}
}

// As returns event number i: kind on proxy id from its writer.
func As(id, kind string, i int) Event { return Make(id, kind, writerSource(kind), i) }

// writerSource is the source of kind's first writer ("test" for a type with
// none).
func writerSource(kind string) string {
	ws := events.Writers(events.AggregateProxy, kind)
	if len(ws) == 0 {
		return "test"
	}
	switch ws[0] {
	case events.WriterAgent:
		return events.AgentSource(Entry, Target)
	case events.WriterHealth:
		return events.SourceHealth
	}
	return events.SourcePlanner
}

func data(id, kind string, i int) any {
	switch kind {
	case events.ProxyRequested:
		return events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: Entry, Target: Target, Instance: events.InstanceName(id), Revision: 1, Port: 3128}}
	case events.ProxyProvisioning:
		return events.ProxyProvisioningData{Entry: Entry, Target: Target, Instance: events.InstanceName(id), ProviderID: fmt.Sprintf("pid-%d", i), Attempt: 1 + i%3}
	case events.ProxyRunning:
		return events.ProxyRunningData{Address: fmt.Sprintf("127.0.0.1:%d", 20000+i), Attempt: 1 + i%3}
	case events.ProxyReady:
		return events.ProxyReadyData{Address: fmt.Sprintf("127.0.0.1:%d", 20000+i), LatencyMS: 5}
	case events.ProxyUnhealthy:
		return events.ProxyUnhealthyData{Reason: "probe failed", Streak: 3}
	case events.ProxyFailed:
		return events.ProxyFailedData{Class: events.ClassPermanent, Reason: fmt.Sprintf("failure %d", i)}
	case events.ProxyRetiring:
		return events.ProxyRetiringData{Reason: fmt.Sprintf("retire %d", i)}
	case events.ProxyDeleted:
		return events.ProxyDeletedData{Attempt: 1}
	case events.ProxyAbandoned:
		return events.ProxyAbandonedData{Reason: "skip cleanup"}
	}
	return map[string]int{"n": i}
}

// Adversarial returns the sequences on which the planner's fold and health's
// projection used to disagree, each on its own proxy whose id starts with
// prefix, in one list.
func Adversarial(prefix string) []Event {
	var out []Event
	seq := func(name string, kinds ...string) {
		id := prefix + "-" + name
		for _, k := range kinds {
			out = append(out, As(id, k, len(out)))
		}
	}
	const (
		req, prov, run, ready, unh = events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy
		fail, ret, del, ab         = events.ProxyFailed, events.ProxyRetiring, events.ProxyDeleted, events.ProxyAbandoned
	)
	seq("retfail", req, prov, run, ret, fail)         // a failure after the retire decision: stays retiring
	seq("failrun", req, prov, fail, prov, run)        // a create finishing after failed: stays failed
	seq("failready", req, run, fail, ready, unh)      // late probes after failed
	seq("retrun", req, prov, ret, run, ready)         // a create finishing after retiring
	seq("reqprov", req, prov, run, req)               // a stale requested after the create started
	seq("reqreq", req, req, prov)                     // a re-issued requested: a new attempt
	seq("deadreq", req, run, del, req, run, ready)    // a deleted proxy absorbs everything
	seq("abreq", req, ret, ab, req, prov)             // so does an abandoned one
	seq("delfirst", del, req, prov)                   // a deleted before requested ended nothing
	seq("failfail", req, fail, fail, ret, ret, del)   // the first failure stands; retire twice
	seq("obsfirst", run, ready, req, unh, ready)      // observations before requested are dropped
	seq("readyunh", req, run, ready, unh, ready, unh) // ready ⇄ unhealthy
	// Facts whose data does not decode move no reader.
	bad := func(e Event, data string) Event { e.Data = json.RawMessage(data); return e }
	out = append(out,
		bad(As(prefix+"-badreq", req, len(out)), `{"pool":"BAD NAME"}`),
		As(prefix+"-badreq", prov, len(out)+1),
		As(prefix+"-baddata", req, len(out)+2),
		As(prefix+"-baddata", prov, len(out)+3),
		bad(As(prefix+"-baddata", run, len(out)+4), `{"attempt":1}`),
		bad(As(prefix+"-baddata", fail, len(out)+5), `{"class":5}`),
		bad(As(prefix+"-baddata", ret, len(out)+6), `[]`),
	)
	// Events from the wrong writer never move a proxy; only the planner's
	// requested creates this one.
	wrong := prefix + "-wrong"
	out = append(out,
		Make(wrong, req, events.AgentSource(Entry, Target), len(out)),
		Make(wrong, req, events.SourcePlanner, len(out)+1),
		Make(wrong, run, events.SourceHealth, len(out)+2),
		Make(wrong, ready, events.AgentSource(Entry, Target), len(out)+3),
		Make(wrong, fail, events.SourceHealth, len(out)+4),
		Make(wrong, del, events.SourcePlanner, len(out)+5),
	)
	// Observations only count from the agent the proxy was placed on,
	// on that agent's subject and with its source: another agent's
	// running, failed or deleted (on its own subject, or forging the
	// source or the subject of the placed agent) and an agent's event on a
	// decision's subject move nothing, nor does a decision on an agent's
	// subject.
	forged := prefix + "-forged"
	placed, other := events.AgentSource(Entry, Target), events.AgentSource(Entry, OtherTarget)
	onSubject := func(e Event, subject string) Event { e.Subject = subject; return e }
	out = append(out,
		As(forged, req, len(out)),
		As(forged, prov, len(out)+1),
		As(forged, run, len(out)+2),
		Make(forged, run, other, len(out)+3),
		Make(forged, fail, other, len(out)+4),
		Make(forged, del, other, len(out)+5),
		onSubject(Make(forged, run, other, len(out)+6), events.ObservationSubject(forged, run, Entry, Target)),
		onSubject(Make(forged, run, placed, len(out)+7), events.ObservationSubject(forged, run, Entry, OtherTarget)),
		onSubject(Make(forged, fail, placed, len(out)+8), events.EventSubject(events.AggregateProxy, forged, fail)),
		onSubject(Make(forged, ret, events.SourcePlanner, len(out)+9), events.ObservationSubject(forged, ret, Entry, Target)),
		onSubject(Make(forged, ready, events.SourceHealth, len(out)+10), events.ObservationSubject(forged, ready, Entry, Target)),
	)
	// Ids that break the identifier rule: never enter state.
	for i, k := range []string{req, prov, run, ready} {
		out = append(out, As("Bad_"+prefix, k, len(out)+i))
	}
	return out
}

// Want returns the state [events.Transition] gives each proxy after evs,
// skipping events [events.CheckEvent] refuses, observations
// [events.CheckPlacement] refuses (by an agent other than the one the
// requested event placed the proxy on) and events whose data
// [events.CheckProxyData] refuses. Proxies no event created are absent.
func Want(evs []Event) map[string]string {
	st := map[string]string{}
	placed := map[string]events.Observer{}
	for _, e := range evs {
		_, _, _, by, ok := events.ParseEventSubject(e.On())
		if !ok || events.CheckEvent(e.Aggregate, e.ID, e.Kind, e.Source, by) != nil {
			continue
		}
		if p, ok := placed[e.ID]; ok && events.CheckPlacement(by, p.Entry, p.Target) != nil {
			continue
		}
		env, err := events.NewEnvelope(e.MsgID, e.Source, events.EnvelopeType(e.Aggregate, e.Kind), e.ID, time.Time{}, e.Data)
		if err != nil || events.CheckProxyData(e.Kind, env) != nil {
			continue
		}
		if to, ok := events.Transition(st[e.ID], e.Kind); ok {
			if st[e.ID] == "" {
				var d events.ProxyRequestedData
				if env.DecodeData(&d) == nil {
					placed[e.ID] = events.Observer{Entry: d.Entry, Target: d.Target}
				}
			}
			st[e.ID] = to
		}
	}
	return st
}

// IDs returns the distinct proxy ids of evs in order of first appearance.
func IDs(evs []Event) []string {
	seen := map[string]bool{}
	var out []string
	for _, e := range evs {
		if !seen[e.ID] {
			seen[e.ID] = true
			out = append(out, e.ID)
		}
	}
	return out
}
