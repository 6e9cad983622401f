package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
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
	Kind      string // event type, the subject's third token
	// By is the agent an observation's subject names (zero for the
	// planner's and the health service's events); readers check it with
	// [events.CheckEvent] and [events.CheckPlacement].
	By     events.Observer
	Header nats.Header
	// Unreadable, when set, is why the message's envelope does not
	// decode; its Envelope is empty and only its position (Seq,
	// Aggregate, ID, Kind, By: from its subject) is known. Readers never
	// act on it (see unreadable.go).
	Unreadable error
}

// EventStore appends to and reads FLEET_EVENTS.
type EventStore struct {
	js     jetstream.JetStream
	source string
	now    func() time.Time
	log    *slog.Logger
	// idKey keys the Msg-Ids of this store's appends (eventids.go).
	idKey []byte
	// stream is FLEET_EVENTS' handle, looked up once (a STREAM.INFO
	// request) and kept: a lookup per read would double the round trips
	// of every state lookup an agent makes per command. See [EventStore.withStream].
	stream atomic.Pointer[jetstream.Stream]
}

// NewEventStore returns a store writing events with the CloudEvents source
// attribute source (e.g. "proxyfleet/planner").
func NewEventStore(c *Conn, source string, log *slog.Logger) *EventStore {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &EventStore{js: c.JS, source: source, now: time.Now, log: log, idKey: c.idKey}
}

// Expect is an optimistic-concurrency condition: the last sequence of the
// aggregate's wildcard subject must be Seq (0 means: no event yet).
type Expect struct {
	Seq uint64
}

// Append writes one event of aggregate/id with the deterministic id msgID,
// on the subject the store's source writes it on ([events.SubjectOf]: an
// agent's proxy events name the agent),
// carrying data and the trace context of ctx. With expect non-nil the append
// succeeds only if the aggregate's last sequence is expect.Seq; a retry of an
// append that already succeeded returns that earlier sequence, not a
// conflict. Without expect (observations) only Msg-Id deduplication applies.
func (s *EventStore) Append(ctx context.Context, aggregate, id, typ, msgID string, data any, expect *Expect) (uint64, error) {
	subject := events.SubjectOf(s.source, aggregate, id, typ)
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
	opts := []jetstream.PublishOpt{jetstream.WithMsgID(msgIDFor(s.idKey, subject, msgID))}
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
// It is a direct get: on a replicated stream any replica may answer, and
// one that lags behind may not hold an append acknowledged a moment ago.
// Decisions made on it are safe all the same, since each carries the
// sequence it expects and the stream refuses a stale one.
func (s *EventStore) Last(ctx context.Context, aggregate, id string) (*Event, error) {
	return s.lastOn(ctx, events.AggregateFilter(aggregate, id))
}

// LastSeenBy returns the last event of proxy id that is either no agent's
// (the planner's decisions, health's observations) or agent by's own, or
// nil when there is none: what agent by acts on, whatever other agents
// record about the proxy. It reads by direct gets alone (no consumer), so
// an agent allowed only direct gets on FLEET_EVENTS can call it.
//
// One read answers it as a rule: the proxy's last event, which is a
// decision or by's own observation unless another agent observed the
// proxy after them (a former placement's agent, or a forgery). Only then
// does it read the last message of [events.DecisionFilter] and of
// [events.AgentFilter] too.
func (s *EventStore) LastSeenBy(ctx context.Context, id string, by events.Observer) (*Event, error) {
	last, err := s.lastOn(ctx, events.AggregateFilter(events.AggregateProxy, id))
	if err != nil || last == nil || last.By.IsZero() || last.By == by {
		// No readable event matches the whole aggregate, so none matches
		// a part of it either.
		return last, err
	}
	dec, err := s.lastOn(ctx, events.DecisionFilter(events.AggregateProxy, id))
	if err != nil {
		return nil, err
	}
	own, err := s.lastOn(ctx, events.AgentFilter(id, by.Entry, by.Target))
	if err != nil {
		return nil, err
	}
	if own != nil && (dec == nil || own.Seq > dec.Seq) {
		return own, nil
	}
	return dec, nil
}

// LastOf returns the last event of type typ of one aggregate, or nil when
// it has none (for example the requested event whose trace a later
// observation continues), whoever wrote it: for a type agents write, on
// [events.EventSubject] and on [events.ObservationFilter] (any agent), so
// the caller checks the event's writer where it matters.
func (s *EventStore) LastOf(ctx context.Context, aggregate, id, typ string) (*Event, error) {
	last, err := s.lastOn(ctx, events.EventSubject(aggregate, id, typ))
	if err != nil || aggregate != events.AggregateProxy || !slices.Contains(events.Writers(aggregate, typ), events.WriterAgent) {
		return last, err
	}
	obs, err := s.lastOn(ctx, events.ObservationFilter(id, typ))
	if err != nil {
		return nil, err
	}
	if obs != nil && (last == nil || obs.Seq > last.Seq) {
		return obs, nil
	}
	return last, nil
}

// LastObservation returns the last observation of type typ of proxy id by
// the agent by ([events.ObservationSubject]), or nil when it has none.
func (s *EventStore) LastObservation(ctx context.Context, id, typ string, by events.Observer) (*Event, error) {
	return s.lastOn(ctx, events.ObservationSubject(id, typ, by.Entry, by.Target))
}

// withStream calls fn with FLEET_EVENTS' handle, looked up on first use
// and kept. When fn fails with a kept handle, the handle may be stale
// (the stream was deleted and created again, possibly with another
// configuration, such as direct gets turned on or off): the handle is
// looked up afresh and fn called once more. fn's own answers that say
// nothing about the handle (message not found) are not retried; fn
// reports them another way.
func (s *EventStore) withStream(ctx context.Context, fn func(jetstream.Stream) error) error {
	if kept := s.stream.Load(); kept != nil {
		err := fn(*kept)
		if err == nil || ctx.Err() != nil {
			return err
		}
		s.stream.CompareAndSwap(kept, nil)
	}
	stream, err := s.js.Stream(ctx, EventsStream)
	if err != nil {
		return err
	}
	s.stream.Store(&stream)
	return fn(stream)
}

func (s *EventStore) lastOn(ctx context.Context, subject string) (*Event, error) {
	var raw *jetstream.RawStreamMsg
	err := s.withStream(ctx, func(stream jetstream.Stream) error {
		var err error
		raw, err = stream.GetLastMsgForSubject(ctx, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			raw, err = nil, nil
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if raw == nil {
		return nil, nil
	}
	return s.lastReadable(ctx, subject, raw.Subject, raw.Sequence, raw.Header, raw.Data)
}

// lastReadable decodes the last message on subject (msgSubject, seq, h,
// data); when it does not read, the last one that does is the answer (a
// read skips the others).
func (s *EventStore) lastReadable(ctx context.Context, subject, msgSubject string, seq uint64, h nats.Header, data []byte) (*Event, error) {
	ev, err := decodeRaw(msgSubject, seq, h, data)
	if err == nil && ev.Unreadable == nil {
		return &ev, nil
	}
	var last *Event
	err = s.read(ctx, subject, 0, false, func(e Event) error {
		if e.Unreadable == nil {
			last = &e
		}
		return nil
	}, nil)
	return last, err
}

// Load returns every event of one aggregate in order, up to its last event
// when Load began.
func (s *EventStore) Load(ctx context.Context, aggregate, id string) ([]Event, error) {
	var out []Event
	err := s.read(ctx, events.AggregateFilter(aggregate, id), 0, false, func(e Event) error {
		out = append(out, e)
		return nil
	}, nil)
	return out, err
}

// Replay calls fn for every event from sequence from (0 or 1: the beginning)
// to the last event of the stream when Replay began, then returns. It
// returns only when that event was delivered, fn failed or ctx ended: a slow
// server or network makes it slower, never shorter.
func (s *EventStore) Replay(ctx context.Context, from uint64, fn func(Event) error) error {
	return s.read(ctx, events.EventsAll, from, false, fn, nil)
}

// Follow calls fn for every event from sequence from, first the history and
// then live events, until ctx ends or fn returns an error. caughtUp, if not
// nil, is called once, on the reading goroutine, right after fn returned for
// the last event of the stream when Follow began (or before any event, when
// the stream has nothing at or after from): from then on the caller's state
// is at least as new as the log was when it started following.
//
// An event whose envelope does not decode is logged, counted and delivered
// with Unreadable set (see unreadable.go), so one bad message never stalls
// a projection; one whose subject has the wrong shape is skipped.
func (s *EventStore) Follow(ctx context.Context, from uint64, fn func(Event) error, caughtUp func()) error {
	return s.read(ctx, events.EventsAll, from, true, fn, caughtUp)
}

// readAhead is how many events a reader asks the server for at once, so the
// next ones are on their way while fn handles the current one.
const readAhead = 1024

// readExpiry is how long each of a reader's pull requests lasts. The
// server sends a heartbeat every half of it, and two missed heartbeats make
// the ordered consumer start over where it was: a consumer lost with a
// cluster node (or to a leader change under load) is noticed within
// readExpiry instead of the client's default of 30 s, during which a read
// would wait for messages that never come.
const readExpiry = 5 * time.Second

// readResetAttempts bounds how often an ordered consumer is recreated under
// the same name before the read fails. A consumer recreated at the instant a
// cluster node dies may be placed on that node, and every later attempt
// under its name waits for the dead node; failing the read lets the caller
// resume from its last event with a new consumer, placed on a live node
// (the planner's follow does, within seconds).
const readResetAttempts = 2

// read delivers the events on filter from sequence from through one
// ordered consumer. Its end (or, following, the caught-up point) is the last
// sequence on filter when the read began. The stream denies delete and
// purge, so that message is removed only if it carried a TTL: the
// planner's fences (each followed by the decisions it fences, so never an
// end), or an event some writer gave a TTL, which no reader acts on. So
// the read reaches its end however long the server takes, never stops at
// a pause that merely looks like the end, and does not wait for an end
// that expired (see nextBefore).
func (s *EventStore) read(ctx context.Context, filter string, from uint64, follow bool, fn func(Event) error, caughtUp func()) error {
	end, err := s.lastSeq(ctx, filter)
	if err != nil {
		return err
	}
	if readEndHook != nil {
		readEndHook()
	}
	from = max(from, 1)
	if end < from {
		if !follow {
			return nil
		}
		if caughtUp != nil {
			caughtUp()
			caughtUp = nil
		}
	}
	var cons jetstream.Consumer
	err = s.withStream(ctx, func(stream jetstream.Stream) error {
		var err error
		cons, err = stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
			FilterSubjects:   []string{filter},
			DeliverPolicy:    jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:      from,
			MaxResetAttempts: readResetAttempts,
		})
		return err
	})
	if err != nil {
		return err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(readAhead), jetstream.PullExpiry(readExpiry))
	if err != nil {
		return err
	}
	defer s.closeReader(ctx, cons, it)
	next := from // the sequence the read waits for
	var wait endWait
	defer wait.stop()
	for {
		msg, err := s.nextBefore(ctx, it, filter, next, &end, &wait)
		if errors.Is(err, errEndGone) {
			// The end expired before it was read (an event that carried a
			// TTL, which nobody acts on): what was delivered is the end.
			if !follow {
				return nil
			}
			if caughtUp != nil {
				caughtUp()
				caughtUp = nil
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("read %s: %w", filter, err)
		}
		md, err := msg.Metadata()
		if err != nil {
			return fmt.Errorf("read %s: %w", filter, err)
		}
		seq := md.Sequence.Stream
		next = seq + 1
		ev, derr := decodeRaw(msg.Subject(), seq, msg.Headers(), msg.Data())
		if ev.Unreadable != nil {
			s.noteUnreadable(ctx, seq, msg.Subject(), ev.Unreadable)
		}
		if derr != nil {
			s.noteUnreadable(ctx, seq, msg.Subject(), derr)
		} else if err := fn(ev); err != nil {
			return err
		}
		if seq >= end {
			if !follow {
				return nil
			}
			if caughtUp != nil {
				caughtUp()
				caughtUp = nil
			}
		}
	}
}

// readEndHook, when set (by tests only), runs once a read knows its end.
var readEndHook func()

// endRecheck is how long a read waits for its next message, before its end
// is reached, until it asks whether that end still exists.
var endRecheck = 5 * time.Second

// errEndGone says a read's end message was removed before it was read.
var errEndGone = errors.New("the end of the read expired")

// endWait is a read's wait for its end: a deadline renewed every
// endRecheck, so a wait costs one timer per period, not one per message.
type endWait struct {
	ctx    context.Context
	cancel context.CancelFunc
	got    bool // a message arrived in this period
}

func (w *endWait) stop() {
	if w.cancel != nil {
		w.cancel()
	}
}

// nextBefore returns the read's next message. Until the read reached its
// end (next <= *end), a period of endRecheck without a message asks for
// the last sequence on filter again: a server that is merely slow still
// holds the end, and the wait goes on; an end removed meanwhile (only a
// message with a TTL can be) returns errEndGone, and *end becomes what is
// left.
func (s *EventStore) nextBefore(ctx context.Context, it jetstream.MessagesContext, filter string, next uint64, end *uint64, w *endWait) (jetstream.Msg, error) {
	for {
		if next > *end {
			w.stop()
			return it.Next(jetstream.NextContext(ctx))
		}
		if w.ctx == nil || w.ctx.Err() != nil {
			w.stop()
			w.ctx, w.cancel = context.WithTimeout(ctx, endRecheck)
			w.got = false
		}
		msg, err := it.Next(jetstream.NextContext(w.ctx))
		if err == nil {
			w.got = true
			return msg, nil
		}
		if ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return nil, err
		}
		if w.got {
			continue // messages still flow: a new period
		}
		last, err := s.lastSeq(ctx, filter)
		if err != nil {
			return nil, err
		}
		if last < next {
			*end = next - 1
			return nil, errEndGone
		}
		// Still there (the server is slow), or the end is gone but
		// messages before it are still to come.
		*end = min(*end, last)
	}
}

// LastSeq returns the sequence of one aggregate's last event, 0 when it has
// none, as the stream leader holds it (unlike [EventStore.Last], never from
// a replica that lags behind): a projection that has reached it holds every
// event of the aggregate acknowledged before the call.
func (s *EventStore) LastSeq(ctx context.Context, aggregate, id string) (uint64, error) {
	return s.lastSeq(ctx, events.AggregateFilter(aggregate, id))
}

// lastSeq is the sequence of the last message on filter, 0 when there is
// none. It asks the stream leader (the message get API): a direct get may be
// answered by a replica that lags behind, which would put the end of a read
// too early.
func (s *EventStore) lastSeq(ctx context.Context, filter string) (uint64, error) {
	m, err := s.leaderLast(ctx, filter)
	if err != nil || m == nil {
		return 0, err
	}
	return m.Seq, nil
}

// storedMsg is a message as the message get API answers it.
type storedMsg struct {
	Subject string `json:"subject"`
	Seq     uint64 `json:"seq"`
	Header  []byte `json:"hdrs"` // the NATS header block, as sent
	Data    []byte `json:"data"`
}

// leaderLast returns the last message on filter as the stream leader holds
// it (the message get API, which only the leader answers), nil when there
// is none.
func (s *EventStore) leaderLast(ctx context.Context, filter string) (*storedMsg, error) {
	req, err := json.Marshal(struct {
		LastBySubject string `json:"last_by_subj"`
	}{filter})
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, verdictTimeout)
	defer cancel()
	msg, err := s.js.Conn().RequestWithContext(rctx, jetstream.DefaultAPIPrefix+"STREAM.MSG.GET."+EventsStream, req)
	if err != nil {
		return nil, fmt.Errorf("last message on %s: %w", filter, err)
	}
	var resp struct {
		Message *storedMsg          `json:"message"`
		Error   *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return nil, fmt.Errorf("last message on %s: %w", filter, err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return nil, nil
	case resp.Error != nil:
		return nil, fmt.Errorf("last message on %s: %w", filter, resp.Error)
	case resp.Message == nil:
		return nil, fmt.Errorf("last message on %s: the server's answer holds no message", filter)
	}
	return resp.Message, nil
}

// lastOnLeader is [EventStore.lastOn] as the stream leader holds it, for
// reads a decision rests on (the current planner term): a replica that
// lags behind could answer a direct get with a term already replaced.
func (s *EventStore) lastOnLeader(ctx context.Context, subject string) (*Event, error) {
	m, err := s.leaderLast(ctx, subject)
	if err != nil || m == nil {
		return nil, err
	}
	return s.lastReadable(ctx, subject, m.Subject, m.Seq, parseHeader(m.Header), m.Data)
}

// parseHeader reads a NATS header block ("NATS/1.0" then "Key: value"
// lines), keeping the keys' case as sent.
func parseHeader(b []byte) nats.Header {
	h := nats.Header{}
	lines := strings.Split(string(b), "\r\n")
	for _, l := range lines[min(1, len(lines)):] {
		k, v, ok := strings.Cut(l, ":")
		if !ok || k == "" {
			continue
		}
		h[k] = append(h[k], strings.TrimSpace(v))
	}
	return h
}

// closeReader stops the iterator and deletes its consumer, which would
// otherwise linger on the server until its inactivity threshold. A read
// that ends with its context leaves that to the server rather than delay
// the caller's shutdown.
func (s *EventStore) closeReader(ctx context.Context, cons jetstream.Consumer, it jetstream.MessagesContext) {
	it.Stop()
	info := cons.CachedInfo()
	if info == nil || ctx.Err() != nil {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.js.DeleteConsumer(dctx, EventsStream, info.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		s.log.Debug("delete a reader's consumer", "consumer", info.Name, "err", err)
	}
}

// Expiring returns an error when the message on subject with headers h
// carries a per-message TTL and is not a planner fence. The stream allows
// such TTLs for the fences alone, but the server lets any writer set one:
// an event that may expire is not history, and acting on it would make a
// later rebuild differ from today's views, so every reader of the log
// treats it as unreadable.
func Expiring(subject string, h nats.Header) error {
	ttl := h.Get(jetstream.MsgTTLHeader)
	if ttl == "" || subject == events.PlannerFenceSubject() {
		return nil
	}
	return fmt.Errorf("it carries a %s header (%s): only the planner's fences may expire", jetstream.MsgTTLHeader, ttl)
}

func decodeRaw(subject string, seq uint64, h nats.Header, data []byte) (Event, error) {
	agg, id, typ, by, ok := events.ParseEventSubject(subject)
	if !ok {
		return Event{}, fmt.Errorf("event subject %q has the wrong shape", subject)
	}
	ev := Event{Seq: seq, Aggregate: agg, ID: id, Kind: typ, By: by, Header: h}
	if err := Expiring(subject, h); err != nil {
		ev.Unreadable = fmt.Errorf("event %d on %s: %w", seq, subject, err)
		return ev, nil
	}
	env, err := events.DecodeEnvelope(data)
	if err != nil {
		ev.Unreadable = fmt.Errorf("event %d on %s: %w", seq, subject, err)
		return ev, nil
	}
	ev.Envelope = env
	return ev, nil
}
