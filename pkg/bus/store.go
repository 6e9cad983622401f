package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// ErrConflict is returned by [EventStore.Append] when the aggregate changed
// since the expected sequence: the caller re-reads and re-decides.
var ErrConflict = errors.New("aggregate changed since it was read")

// jsErrWrongLastSequence is JetStream's "wrong last sequence" error code.
const jsErrWrongLastSequence = 10071

// Event is an envelope read back from FLEET_EVENTS with its stream position.
type Event struct {
	events.Envelope
	Seq       uint64
	Aggregate string
	ID        string // aggregate id
	Kind      string // event type, the subject's last token
	Header    nats.Header
}

// EventStore appends to and reads FLEET_EVENTS.
type EventStore struct {
	js     jetstream.JetStream
	source string
	now    func() time.Time
	log    *slog.Logger
}

// NewEventStore returns a store writing events with the CloudEvents source
// attribute source (e.g. "proxyfleet/planner").
func NewEventStore(c *Conn, source string, log *slog.Logger) *EventStore {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &EventStore{js: c.JS, source: source, now: time.Now, log: log}
}

// Expect is an optimistic-concurrency condition: the last sequence of the
// aggregate's wildcard subject must be Seq (0 means: no event yet).
type Expect struct {
	Seq uint64
}

// Append writes one event of aggregate/id with the deterministic id msgID,
// carrying data and the trace context of ctx. With expect non-nil the append
// succeeds only if the aggregate's last sequence is expect.Seq; a retry of an
// append that already succeeded returns that earlier sequence, not a
// conflict. Without expect (observations) only Msg-Id deduplication applies.
func (s *EventStore) Append(ctx context.Context, aggregate, id, typ, msgID string, data any, expect *Expect) (uint64, error) {
	subject := events.EventSubject(aggregate, id, typ)
	env, err := events.NewEnvelope(msgID, s.source, events.EnvelopeType(aggregate, typ), id, s.now(), data)
	if err != nil {
		return 0, err
	}
	body, err := env.MarshalJSON()
	if err != nil {
		return 0, err
	}
	msg := nats.NewMsg(subject)
	msg.Data = body
	telemetry.Inject(ctx, msg.Header)
	opts := []jetstream.PublishOpt{jetstream.WithMsgID(msgID)}
	if expect != nil {
		opts = append(opts, jetstream.WithExpectLastSequenceForSubject(expect.Seq, events.AggregateFilter(aggregate, id)))
	}
	ack, err := s.js.PublishMsg(ctx, msg, opts...)
	if err == nil {
		return ack.Sequence, nil
	}
	var apiErr *jetstream.APIError
	if expect != nil && errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrWrongLastSequence {
		// A retry of our own earlier success looks like a conflict: the
		// aggregate moved on, by us. Check the last message's id.
		last, lerr := s.Last(ctx, aggregate, id)
		if lerr == nil && last != nil && last.Envelope.ID == msgID {
			return last.Seq, nil
		}
		return 0, fmt.Errorf("append %s: %w", subject, ErrConflict)
	}
	return 0, fmt.Errorf("append %s: %w", subject, err)
}

// Last returns the last event of one aggregate, or nil when it has none.
func (s *EventStore) Last(ctx context.Context, aggregate, id string) (*Event, error) {
	return s.lastOn(ctx, events.AggregateFilter(aggregate, id))
}

// LastOf returns the last event of type typ of one aggregate, or nil when
// it has none (for example the requested event whose trace a later
// observation continues).
func (s *EventStore) LastOf(ctx context.Context, aggregate, id, typ string) (*Event, error) {
	return s.lastOn(ctx, events.EventSubject(aggregate, id, typ))
}

func (s *EventStore) lastOn(ctx context.Context, subject string) (*Event, error) {
	stream, err := s.js.Stream(ctx, EventsStream)
	if err != nil {
		return nil, err
	}
	raw, err := stream.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return decodeRaw(raw.Subject, raw.Sequence, raw.Header, raw.Data)
}

// Load returns every event of one aggregate in order.
func (s *EventStore) Load(ctx context.Context, aggregate, id string) ([]Event, error) {
	var out []Event
	err := s.read(ctx, events.AggregateFilter(aggregate, id), 0, false, func(e Event) error {
		out = append(out, e)
		return nil
	}, nil)
	return out, err
}

// Replay calls fn for every event from sequence from (0 or 1: the beginning)
// to the current end of the stream, then returns.
func (s *EventStore) Replay(ctx context.Context, from uint64, fn func(Event) error) error {
	return s.read(ctx, events.EventsAll, from, false, fn, nil)
}

// Follow calls fn for every event from sequence from, first the history and
// then live events, until ctx ends or fn returns an error. caughtUp, if not
// nil, is called once when the history has been delivered.
//
// Events that fail to decode are logged and skipped, in every reader, so one
// bad message never stalls a projection.
func (s *EventStore) Follow(ctx context.Context, from uint64, fn func(Event) error, caughtUp func()) error {
	return s.read(ctx, events.EventsAll, from, true, fn, caughtUp)
}

func (s *EventStore) read(ctx context.Context, filter string, from uint64, follow bool, fn func(Event) error, caughtUp func()) error {
	stream, err := s.js.Stream(ctx, EventsStream)
	if err != nil {
		return err
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return err
	}
	end := info.State.LastSeq
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}, DeliverPolicy: jetstream.DeliverAllPolicy}
	if from > 1 {
		cfg.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cfg.OptStartSeq = from
	}
	if !follow && (end == 0 || end < from) {
		return nil
	}
	cons, err := stream.OrderedConsumer(ctx, cfg)
	if err != nil {
		return err
	}
	signalled := false
	signal := func() {
		if !signalled {
			signalled = true
			if caughtUp != nil {
				caughtUp()
			}
		}
	}
	if end == 0 || end < from {
		signal()
	}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		wait := 500 * time.Millisecond
		if !follow {
			wait = 100 * time.Millisecond
		}
		batch, err := cons.Fetch(256, jetstream.FetchMaxWait(wait))
		if err != nil {
			if errors.Is(err, context.Canceled) || ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			md, err := msg.Metadata()
			if err != nil {
				return err
			}
			ev, derr := decodeRaw(msg.Subject(), md.Sequence.Stream, msg.Headers(), msg.Data())
			if derr != nil {
				s.log.Error("skipping undecodable event", "seq", md.Sequence.Stream, "subject", msg.Subject(), "err", derr)
			} else if err := fn(*ev); err != nil {
				return err
			}
			if md.NumPending == 0 || md.Sequence.Stream >= end {
				if !follow {
					// Let the fetch finish so no goroutine outlives the read.
					for range batch.Messages() {
					}
					return nil
				}
				signal()
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, jetstream.ErrNoMessages) {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		if n == 0 {
			if !follow {
				// Everything up to end was filtered out for this subject.
				return nil
			}
			signal()
		}
	}
}

func decodeRaw(subject string, seq uint64, h nats.Header, data []byte) (*Event, error) {
	agg, id, typ, ok := events.ParseEventSubject(subject)
	if !ok {
		return nil, fmt.Errorf("event subject %q has the wrong shape", subject)
	}
	env, err := events.DecodeEnvelope(data)
	if err != nil {
		return nil, fmt.Errorf("event %d on %s: %w", seq, subject, err)
	}
	return &Event{Envelope: env, Seq: seq, Aggregate: agg, ID: id, Kind: typ, Header: h}, nil
}
