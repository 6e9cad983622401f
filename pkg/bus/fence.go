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

// CurrentTerm returns the latest term, or nil when no planner ever led.
func (s *EventStore) CurrentTerm(ctx context.Context) (*Term, error) {
	ev, err := s.lastOn(ctx, events.PlannerTermSubject())
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
	ack, err := s.js.PublishMsg(ctx, msg, jetstream.WithMsgID(msgID), jetstream.WithExpectLastSequencePerSubject(after))
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrWrongLastSequence {
		return Term{}, fmt.Errorf("open planner term %d: %w", next.Number, ErrConflict)
	}
	if err != nil {
		return Term{}, fmt.Errorf("open planner term %d: %w", next.Number, err)
	}
	next.Seq = ack.Sequence
	return next, nil
}

// AppendFenced is [EventStore.Append] for a leader's decision: the event is
// stored only while term is still the latest term (see the fencing notes
// above), and it records the term and the leader in the envelope's
// extension attributes (events.ExtLeaderTerm, events.ExtLeader). It fails
// with [ErrFenced] when a newer term has opened and with [ErrConflict] when
// expect no longer holds; in both cases nothing is stored.
func (s *EventStore) AppendFenced(ctx context.Context, term Term, aggregate, id, typ, msgID string, data any, expect *Expect) (uint64, error) {
	subject := events.EventSubject(aggregate, id, typ)
	env, err := events.NewEnvelope(msgID, s.source, events.EnvelopeType(aggregate, typ), id, s.now(), data)
	if err != nil {
		return 0, err
	}
	env.SetLeader(term.Number, term.Leader)
	body, err := env.MarshalJSON()
	if err != nil {
		return 0, err
	}
	fenceEnv, err := events.NewEnvelope(msgID+".fence", s.source, events.EnvelopeType(events.AggregatePlanner, events.PlannerFence), "leader", s.now(),
		events.PlannerFenceData{Term: term.Number, Leader: term.Leader})
	if err != nil {
		return 0, err
	}
	fenceBody, err := fenceEnv.MarshalJSON()
	if err != nil {
		return 0, err
	}
	batch := rand.Text()

	fence := nats.NewMsg(events.PlannerFenceSubject())
	fence.Data = fenceBody
	fence.Header.Set(hdrBatchID, batch)
	fence.Header.Set(hdrBatchSeq, "1")
	fence.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(term.Seq, 10))
	fence.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, events.PlannerTermSubject())
	fence.Header.Set(jetstream.MsgTTLHeader, FenceTTL)

	msg := nats.NewMsg(subject)
	msg.Data = body
	telemetry.Inject(ctx, msg.Header)
	msg.Header.Set(jetstream.MsgIDHeader, msgID)
	msg.Header.Set(hdrBatchID, batch)
	msg.Header.Set(hdrBatchSeq, "2")
	msg.Header.Set(hdrBatchCommit, "1")
	if expect != nil {
		msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect.Seq, 10))
		msg.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, events.AggregateFilter(aggregate, id))
	}

	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("append %s: %w", subject, err)
	}
	// The staged message needs no acknowledgement: the commit's reply says
	// whether the whole batch was stored, and one connection keeps the
	// order of the two.
	nc := s.js.Conn()
	if err := nc.PublishMsg(fence); err != nil {
		return 0, fmt.Errorf("append %s: %w", subject, err)
	}
	// Once the batch is on its way its outcome is decided by the server:
	// wait for the verdict even when ctx ends meanwhile, so the caller
	// learns whether it was stored, refused or deposed.
	vctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verdictTimeout)
	defer cancel()
	ack, err := s.js.PublishMsg(vctx, msg)
	if err == nil {
		return ack.Sequence, nil
	}
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return 0, fmt.Errorf("append %s: %w", subject, err)
	}
	switch apiErr.ErrorCode {
	case jsErrWrongLastSequence, jsErrWrongLastSequenceConstant, jsErrAtomicPublishDuplicate:
		// Either expectation failed, or the Msg-Id is a retry of an
		// earlier success (a batch refuses duplicates instead of
		// acknowledging them).
		cur, terr := s.CurrentTerm(vctx)
		if terr != nil {
			return 0, fmt.Errorf("append %s: %w (reading the planner term: %v)", subject, err, terr)
		}
		last, lerr := s.Last(vctx, aggregate, id)
		if lerr == nil && last != nil && last.Envelope.ID == msgID {
			return last.Seq, nil
		}
		if cur == nil || cur.Seq != term.Seq {
			return 0, fmt.Errorf("append %s in term %d: %w", subject, term.Number, ErrFenced)
		}
		return 0, fmt.Errorf("append %s: %w", subject, ErrConflict)
	case jsErrAtomicPublishDisabled:
		return 0, fmt.Errorf("append %s: stream %s does not allow atomic batches; start any service with --ensure-topology (the default) to update it: %w", subject, EventsStream, err)
	}
	return 0, fmt.Errorf("append %s: %w", subject, err)
}
