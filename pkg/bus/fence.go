package bus

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// Leader fencing.
//
// A planner replica that acquires the leader lease opens a term: it appends
// a term event to [events.PlannerTermSubject], expecting the last sequence
// of that subject it read ([EventStore.ClaimTerm]). The term event's stream
// sequence is its fencing token. Every reconciler decision is then appended
// as an atomic batch ([EventStore.AppendFenced]) of two messages:
//
//  1. a fence message on [events.PlannerFenceSubject] whose
//     Nats-Expected-Last-Subject-Sequence(-Subject) names the term subject
//     and the leader's token, with a short Nats-TTL;
//  2. the decision, with its Msg-Id and its own expectation on the
//     aggregate's wildcard, committing the batch.
//
// The server checks both expectations when the commit arrives and stores
// both messages or neither, so a leader that was paused past its lease,
// while another replica opened a newer term, cannot append a decision
// however late its bytes reach the server. A clock check in the process
// could not promise that: the process can stop between the check and the
// publish.

// FenceTTL is the per-message TTL of fence messages: they matter only at the
// instant their batch commits.
const FenceTTL = "1s"

// verdictTimeout bounds the wait for the server's answer to a fenced
// append, and the reads that explain a refusal.
const verdictTimeout = 10 * time.Second

// ErrFenced is returned by [EventStore.AppendFenced] when a newer leader
// term has opened: the caller is no longer the leader and must stop
// deciding. Nothing was stored.
var ErrFenced = errors.New("a newer planner term has opened: this replica was deposed")

// JetStream error codes of atomic batch publishing.
const (
	jsErrWrongLastSequenceConstant = 10164
	jsErrAtomicPublishDisabled     = 10174
	jsErrAtomicPublishDuplicate    = 10201
)

// Header names of atomic batch publishing (nats-server 2.12+).
const (
	hdrBatchID     = "Nats-Batch-Id"
	hdrBatchSeq    = "Nats-Batch-Sequence"
	hdrBatchCommit = "Nats-Batch-Commit"
)

// Term is one leader term as stored in FLEET_EVENTS.
type Term struct {
	// Seq is the stream sequence of the term event: the fencing token.
	Seq uint64
	// Number is the term's number (1, 2, …).
	Number uint64
	// Leader is the replica id that opened the term.
	Leader string
}

// CurrentTerm returns the latest term, or nil when no planner ever led, as
// the stream leader holds it (never from a replica that lags behind).
func (s *EventStore) CurrentTerm(ctx context.Context) (*Term, error) {
	ev, err := s.lastOnLeader(ctx, events.PlannerTermSubject())
	if err != nil || ev == nil {
		return nil, err
	}
	var d events.PlannerTermData
	if err := ev.DecodeData(&d); err != nil {
		return nil, fmt.Errorf("term event %d: %w", ev.Seq, err)
	}
	return &Term{Seq: ev.Seq, Number: d.Term, Leader: d.Leader}, nil
}

// ClaimTerm opens the next leader term for replica leader, which holds the
// leader lease at revision lease. It fails with [ErrConflict] when another
// replica opened a term after this one read the current term.
func (s *EventStore) ClaimTerm(ctx context.Context, leader string, lease uint64) (Term, error) {
	cur, err := s.CurrentTerm(ctx)
	if err != nil {
		return Term{}, fmt.Errorf("read the current planner term: %w", err)
	}
	var after uint64
	next := Term{Number: 1, Leader: leader}
	if cur != nil {
		after, next.Number = cur.Seq, cur.Number+1
	}
	// The Msg-Id names the claimant, so a rival claiming the same number is
	// refused by the expectation rather than deduplicated into a false
	// success.
	msgID := "planner.term." + strconv.FormatUint(next.Number, 10) + "." + leader + "." + strconv.FormatUint(lease, 10)
	env, err := events.NewEnvelope(msgID, s.source, events.EnvelopeType(events.AggregatePlanner, events.PlannerTerm), "leader", s.now(),
		events.PlannerTermData{Term: next.Number, Leader: leader, Lease: lease})
	if err != nil {
		return Term{}, err
	}
	body, err := env.MarshalJSON()
	if err != nil {
		return Term{}, err
	}
	msg := nats.NewMsg(events.PlannerTermSubject())
	msg.Data = body
	for attempt := 1; ; attempt++ {
		ack, err := s.js.PublishMsg(ctx, msg, jetstream.WithMsgID(msgIDFor(s.idKey, msg.Subject, msgID)), jetstream.WithExpectLastSequencePerSubject(after))
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && (apiErr.ErrorCode == jsErrWrongLastSequence || apiErr.ErrorCode == jsErrWrongLastSequenceConstant) {
			last, ok := s.lastClaim(ctx)
			switch {
			case ok && last != nil && last.Seq > after && last.Envelope.ID == msgID:
				// The claim itself is there: an attempt stored while
				// its answer was lost (a stream leader change) and
				// the publish sent again.
				next.Seq = last.Seq
				return next, nil
			case ok && lastSeqOf(last) == after && attempt < claimAttempts:
				// Nobody else claimed: a replicated stream refuses an
				// expectation while it is unsure of the subject (a
				// write still in flight, a new stream leader). The
				// expectation still guards the claim: try again.
				select {
				case <-ctx.Done():
					return Term{}, fmt.Errorf("open planner term %d: %w", next.Number, ctx.Err())
				case <-time.After(time.Duration(attempt) * 100 * time.Millisecond):
				}
				continue
			case ok && lastSeqOf(last) == after:
				return Term{}, fmt.Errorf("open planner term %d: the server refused the claim %d times though no other claim is stored (%v); retry", next.Number, attempt, err)
			}
			return Term{}, fmt.Errorf("open planner term %d: %w", next.Number, ErrConflict)
		}
		if err != nil {
			return Term{}, fmt.Errorf("open planner term %d: %w", next.Number, err)
		}
		next.Seq = ack.Sequence
		return next, nil
	}
}

// claimAttempts bounds how often ClaimTerm sends a claim the server
// refused while no other claim was stored.
const claimAttempts = 3

// lastClaim reads the last term event (nil when there is none); ok is
// false when the read failed.
func (s *EventStore) lastClaim(ctx context.Context) (last *Event, ok bool) {
	ev, err := s.lastOnLeader(ctx, events.PlannerTermSubject())
	return ev, err == nil
}

// lastSeqOf is ev's sequence, 0 for none.
func lastSeqOf(ev *Event) uint64 {
	if ev == nil {
		return 0
	}
	return ev.Seq
}

// AppendFenced is [EventStore.Append] for a leader's decision: the event is
// stored only while term is still the latest term (see the fencing notes
// above), and it records the term and the leader in the envelope's
// extension attributes (events.ExtLeaderTerm, events.ExtLeader). It fails
// with [ErrFenced] when a newer term has opened and with [ErrConflict] when
// expect no longer holds; in both cases nothing is stored.
func (s *EventStore) AppendFenced(ctx context.Context, term Term, aggregate, id, typ, msgID string, data any, expect *Expect) (uint64, error) {
	return s.StartFenced(ctx, term, Decision{Aggregate: aggregate, ID: id, Type: typ, MsgID: msgID, Data: data, Expect: expect}).Wait(ctx)
}

// Decision is one event a leader decides: its aggregate, type,
// deterministic id (the Msg-Id) and data, and the last sequence its
// aggregate must have when the batch that carries it commits (nil: no
// expectation, for the later events of one aggregate in one batch).
type Decision struct {
	Aggregate, ID string
	Type, MsgID   string
	Data          any
	Expect        *Expect
	// Trace is the trace context the event carries (telemetry.Inject of
	// the decision's context); nil: the context StartFenced is given.
	Trace nats.Header
}

// FencedAppend is a fenced batch on its way to the server; [FencedAppend.Wait]
// reads the verdict.
type FencedAppend struct {
	s       *EventStore
	term    Term
	subject string
	// single is the batch's one decision, when it has one: a refused
	// retry of it may be its own earlier success.
	single *Decision
	ack    jetstream.PubAckFuture
	err    error
}

// maxBatchDecisions is the most decisions one fenced batch may carry (the
// server's limit on an atomic batch is 1,000 messages, the fence included).
const maxBatchDecisions = 999

// StartFenced sends one fenced atomic batch: the fence message, checked
// against term, then the decisions ds in order, each with its own
// expectation and recording the term and the leader. The server stores
// all of them or none. It returns without waiting for the server's
// verdict, so the caller can prepare its next batch meanwhile;
// [FencedAppend.Wait] reads the verdict, and every batch's verdict must be
// read. Keep one fenced batch in flight at a time: on a replicated stream
// the server refuses (as a wrong last sequence) a batch whose fence
// expectation meets the term subject still in process for the batch
// before it.
//
// A batch costs the server a fixed price (it stages the batch in a store
// of its own) on top of its messages, so a leader with many decisions to
// take sends many in one batch. Two decisions on one aggregate in one
// batch must not both expect its sequence: the later one rides on the
// first's expectation.
func (s *EventStore) StartFenced(ctx context.Context, term Term, ds ...Decision) *FencedAppend {
	a := &FencedAppend{s: s, term: term}
	switch {
	case len(ds) == 0:
		a.err = errors.New("a fenced batch needs a decision")
		return a
	case len(ds) > maxBatchDecisions:
		a.err = fmt.Errorf("a fenced batch carries at most %d decisions, not %d", maxBatchDecisions, len(ds))
		return a
	case len(ds) == 1:
		a.single = &ds[0]
	}
	last := ds[len(ds)-1]
	a.subject = events.SubjectOf(s.source, last.Aggregate, last.ID, last.Type)
	if err := ctx.Err(); err != nil {
		a.err = fmt.Errorf("append %s: %w", a.subject, err)
		return a
	}
	fenceEnv, err := events.NewEnvelope(ds[0].MsgID+".fence", s.source, events.EnvelopeType(events.AggregatePlanner, events.PlannerFence), "leader", s.now(),
		events.PlannerFenceData{Term: term.Number, Leader: term.Leader})
	if err != nil {
		a.err = err
		return a
	}
	fenceBody, err := fenceEnv.MarshalJSON()
	if err != nil {
		a.err = err
		return a
	}
	batch := rand.Text()
	fence := nats.NewMsg(events.PlannerFenceSubject())
	fence.Data = fenceBody
	fence.Header.Set(hdrBatchID, batch)
	fence.Header.Set(hdrBatchSeq, "1")
	fence.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(term.Seq, 10))
	fence.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, events.PlannerTermSubject())
	fence.Header.Set(jetstream.MsgTTLHeader, FenceTTL)
	msgs := []*nats.Msg{fence}
	for i, d := range ds {
		env, err := events.NewEnvelope(d.MsgID, s.source, events.EnvelopeType(d.Aggregate, d.Type), d.ID, s.now(), d.Data)
		if err != nil {
			a.err = err
			return a
		}
		env.SetLeader(term.Number, term.Leader)
		body, err := env.MarshalJSON()
		if err != nil {
			a.err = err
			return a
		}
		msg := nats.NewMsg(events.SubjectOf(s.source, d.Aggregate, d.ID, d.Type))
		msg.Data = body
		if d.Trace != nil {
			for k, v := range d.Trace {
				msg.Header[k] = v
			}
		} else {
			telemetry.Inject(ctx, msg.Header)
		}
		msg.Header.Set(jetstream.MsgIDHeader, msgIDFor(s.idKey, msg.Subject, d.MsgID))
		msg.Header.Set(hdrBatchID, batch)
		msg.Header.Set(hdrBatchSeq, strconv.Itoa(i+2))
		if d.Expect != nil {
			msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(d.Expect.Seq, 10))
			msg.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, events.AggregateFilter(d.Aggregate, d.ID))
		}
		msgs = append(msgs, msg)
	}
	commit := msgs[len(msgs)-1]
	commit.Header.Set(hdrBatchCommit, "1")
	// The staged messages need no acknowledgement: the commit's reply says
	// whether the whole batch was stored, and one connection keeps the
	// order of the messages.
	nc := s.js.Conn()
	for _, m := range msgs[:len(msgs)-1] {
		if err := nc.PublishMsg(m); err != nil {
			a.err = fmt.Errorf("append %s: %w", a.subject, err)
			return a
		}
	}
	if a.ack, err = s.js.PublishMsgAsync(commit); err != nil {
		a.err = fmt.Errorf("append %s: %w", a.subject, err)
	}
	return a
}

// Wait returns the stream sequence of the batch's last event once the
// server stored the batch (its events are stored together, ending there).
// It fails with [ErrFenced] when a newer term has opened and with
// [ErrConflict] when an expectation of the batch no longer holds, or when
// a batch of several decisions holds one the server stored before (a
// batch refuses duplicates rather than acknowledging them): in both cases
// nothing was stored, and a caller with several decisions in the batch
// learns which by sending them in smaller batches. A retry of a lone
// decision the server stored before returns that decision's sequence.
// Once the batch is on its way its outcome is decided by the server, so
// Wait reads the verdict even when ctx ends meanwhile (up to a bound), and
// the caller learns whether it was stored, refused or deposed.
func (a *FencedAppend) Wait(ctx context.Context) (uint64, error) {
	if a.err != nil {
		return 0, a.err
	}
	vctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verdictTimeout)
	defer cancel()
	var err error
	select {
	case ack := <-a.ack.Ok():
		return ack.Sequence, nil
	case err = <-a.ack.Err():
	case <-vctx.Done():
		return 0, fmt.Errorf("append %s: no verdict from the server within %s", a.subject, verdictTimeout)
	}
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return 0, fmt.Errorf("append %s: %w", a.subject, err)
	}
	switch apiErr.ErrorCode {
	case jsErrWrongLastSequence, jsErrWrongLastSequenceConstant, jsErrAtomicPublishDuplicate:
		// Either expectation failed, or a Msg-Id is a retry of an
		// earlier success.
		// The term as the stream leader holds it: a direct get may be
		// answered by a replica that has not yet stored the newer term
		// that refused this batch, which would read as a conflict.
		termSeq, terr := a.s.lastSeq(vctx, events.PlannerTermSubject())
		if terr != nil {
			return 0, fmt.Errorf("append %s: %w (reading the planner term: %v)", a.subject, err, terr)
		}
		if d := a.single; d != nil {
			last, lerr := a.s.Last(vctx, d.Aggregate, d.ID)
			if lerr == nil && last != nil && last.Envelope.ID == d.MsgID {
				return last.Seq, nil
			}
		}
		if termSeq != a.term.Seq {
			return 0, fmt.Errorf("append %s in term %d: %w", a.subject, a.term.Number, ErrFenced)
		}
		return 0, fmt.Errorf("append %s: %w", a.subject, ErrConflict)
	case jsErrAtomicPublishDisabled:
		return 0, fmt.Errorf("append %s: stream %s does not allow atomic batches; start any service with --ensure-topology (the default) to update it: %w", a.subject, EventsStream, err)
	}
	return 0, fmt.Errorf("append %s: %w", a.subject, err)
}
