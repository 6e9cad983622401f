package events

import (
	"encoding/json"
	"strconv"
)

// AggregatePlanner is the aggregate of the planner's own bookkeeping in
// FLEET_EVENTS: leader terms and decision fences. It describes no proxy or
// pool; readers that project proxies and pools skip it.
const AggregatePlanner = "planner"

// plannerID is the one id of the planner aggregate.
const plannerID = "leader"

// Planner event types.
const (
	// PlannerTerm records that a replica took the leader lease and now
	// decides; see [PlannerTermSubject].
	PlannerTerm = "term"
	// PlannerFence travels in the same atomic batch as every reconciler
	// decision; see [PlannerFenceSubject].
	PlannerFence = "fence"
)

// PlannerTermSubject returns "fleet.evt.planner.leader.term". Each message
// on it opens a leader term. A replica that acquires the leader lease
// appends one, expecting the subject's last sequence it read, so two
// replicas cannot open the same term; the stream sequence of its term
// event is the leader's fencing token.
func PlannerTermSubject() string { return EventSubject(AggregatePlanner, plannerID, PlannerTerm) }

// PlannerFenceSubject returns "fleet.evt.planner.leader.fence". A fence
// message is stored in the same atomic batch as a reconciler decision and
// expects [PlannerTermSubject]'s last sequence to be the deciding leader's
// term event, so the whole batch, decision included, is rejected once
// another term has opened. Fence messages carry a short per-message TTL.
func PlannerFenceSubject() string { return EventSubject(AggregatePlanner, plannerID, PlannerFence) }

// PlannerTermData is the data of a term event.
type PlannerTermData struct {
	// Term numbers the leader terms: 1, 2, … (the previous term's plus one).
	Term uint64 `json:"term"`
	// Leader is the replica id that opened the term.
	Leader string `json:"leader"`
	// Lease is the revision of the leader lease (KV fleet-planner) the
	// replica held when it opened the term.
	Lease uint64 `json:"lease"`
}

// PlannerFenceData is the data of a fence message.
type PlannerFenceData struct {
	Term   uint64 `json:"term"`
	Leader string `json:"leader"`
}

// CloudEvents extension attributes on every reconciler decision: the term
// number and the replica that decided it, so the log says which leader
// appended each decision.
const (
	ExtLeaderTerm = "leaderterm"
	ExtLeader     = "leader"
)

// SetLeader records the deciding leader's term and replica id in e's
// extension attributes.
func (e *Envelope) SetLeader(term uint64, leader string) {
	if e.Extensions == nil {
		e.Extensions = map[string]json.RawMessage{}
	}
	e.Extensions[ExtLeaderTerm] = json.RawMessage(strconv.FormatUint(term, 10))
	name, _ := json.Marshal(leader)
	e.Extensions[ExtLeader] = name
}

// Leader returns the term and replica id recorded by [Envelope.SetLeader];
// ok is false for events that are not reconciler decisions.
func (e Envelope) Leader() (term uint64, leader string, ok bool) {
	rawTerm, ok1 := e.Extensions[ExtLeaderTerm]
	rawLeader, ok2 := e.Extensions[ExtLeader]
	if !ok1 || !ok2 {
		return 0, "", false
	}
	if json.Unmarshal(rawTerm, &term) != nil || json.Unmarshal(rawLeader, &leader) != nil {
		return 0, "", false
	}
	return term, leader, true
}
