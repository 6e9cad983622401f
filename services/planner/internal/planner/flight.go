package planner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/planner/internal/decide"
)

// Pipelined decisions.
//
// A round may decide thousands of things (a pool of 10,000 filled at
// once). Appending each decision and publishing its command one round trip
// at a time bounds the planner by the round-trip time, and a fenced
// decision alone costs the server a batch of its own (it stages each
// atomic batch in a store), so a round batches and pipelines them: its
// decisions go out in fenced atomic batches of up to batchDecisions; while
// the server judges one batch the round fills the next (one batch is in
// flight at a time: a replicated stream refuses a fenced batch while the
// one before it is in process); the command of a stored decision is
// published without waiting for its acknowledgement. A round reads every
// verdict and every acknowledgement, in the order it sent them, before it
// ends.
//
// This keeps every guarantee of a decision taken alone:
//   - the fence: each batch is checked against the leader's term when it
//     commits, so a deposed leader's batches in flight are all refused;
//   - optimistic concurrency: each decision expects its aggregate's last
//     sequence as the round read it. A refused batch is sent again split
//     in two, down to single decisions, so only the decision whose
//     expectation failed is dropped (and decided again next round from
//     the newer state); two decisions of one round on one aggregate (a
//     proxy failed for a timeout and retired for a scale-down) go in
//     different batches, and the second, expecting what the first changed,
//     is refused as it was when they went one after the other;
//   - crash safety: a batch is stored whole or not at all, and a decision's
//     command is published only once it is stored, with the Msg-Id of the
//     decision's attempt, so a round repeated after a crash at any point
//     appends nothing twice (the state it decides from holds what was
//     stored; a lone decision sent again is recognised as its own earlier
//     success) and re-sends a command JetStream drops as a duplicate; a
//     command whose publish failed waits in the outbox, and a new leader
//     re-publishes the commands of unfinished decisions (recoverCommands).

// batchDecisions is how many decisions one fenced batch carries at most:
// enough to spread the batch's fixed cost thin, few enough that a refused
// batch is split down to its culprit in a handful of steps.
const batchDecisions = 256

// flightBatches is how many batches a round keeps in flight at most (see
// [bus.EventStore.StartFenced]).
const flightBatches = 1

// commandTimeout bounds the wait for a command's acknowledgement; a
// command not acknowledged in time is retried from the outbox.
const commandTimeout = 10 * time.Second

// flight is the decisions and commands of one round in flight. It belongs
// to the reconciler goroutine.
type flight struct {
	p *Planner
	// rc is the reconciler whose flight this is; nil for an intent's.
	rc  *reconciler
	ctx context.Context
	// term, when set, fences the flight's batches instead of the term this
	// replica leads: an operator's intent (pool.apply, pool.delete), which
	// any replica takes, is fenced by the latest term it read.
	term *bus.Term
	// open is the batch being filled; inFlight the batches sent.
	open     *batch
	inFlight []*batch
	commands []*commandInFlight
	// unstored names the pools of decisions that were not stored: a round
	// looks at them again.
	unstored map[string]bool
}

// unit is the decisions of one f.decide call: events on one aggregate,
// stored together or not at all.
type unit struct {
	ctx  context.Context
	span trace.Span
	// pub is the producer span of appending the decisions.
	pub  trace.Span
	pool string // the pool the decisions are about
	ds   []bus.Decision
	what string // "<aggregate> <id> <type>", for logs
	log  []any  // the "decided" log line's attributes
	// stored runs once the unit is stored, with the sequence of its last
	// event: typically it sends the decision's command.
	stored func(ctx context.Context, seq uint64)
	// seq and err are the unit's verdict once the flight settled it: the
	// sequence of its last event, or why it was not stored.
	seq uint64
	err error
}

// errNotSent: the unit was not sent, since this replica does not lead (or
// no longer does).
var errNotSent = errors.New("not the leader: decision not sent")

// batch is units sent (or to be sent) as one fenced batch.
type batch struct {
	units  []*unit
	n      int             // decisions
	keys   map[string]bool // "<aggregate>.<id>" of its units
	append *bus.FencedAppend
}

// commandInFlight is one command awaiting its acknowledgement.
type commandInFlight struct {
	ctx  context.Context
	span trace.Span // the publish span
	pc   pending
	ack  jetstream.PubAckFuture
	// err, once the flight settled, is why the command was not
	// acknowledged (it waits in the outbox), nil when it was.
	err error
}

// newFlight starts a flight outside the reconciler: an intent's, whose
// term the caller sets.
func (p *Planner) newFlight(ctx context.Context) *flight {
	return &flight{p: p, ctx: ctx, unstored: map[string]bool{}}
}

// flight starts the flight of one round or job of the reconciler.
func (rc *reconciler) flight(ctx context.Context) *flight {
	f := rc.newFlight(ctx)
	f.rc = rc
	return f
}

// decide adds one unit of decisions about pool on one aggregate, the first
// expecting expect, to the round's batches. Nothing is sent when this replica does
// not lead, and it is deposed when its lease went unrenewed for a whole
// TTL (a cheap early check; the store's fence is the guarantee). span, if
// not nil, ends once the unit is settled.
func (f *flight) decide(ctx context.Context, span trace.Span, pool, aggregate, id string, expect *bus.Expect, ds []bus.Decision,
	logArgs []any, stored func(context.Context, uint64)) *unit {
	p := f.p
	typ := ds[len(ds)-1].Type
	u := &unit{ctx: ctx, span: span, pool: pool, what: aggregate + " " + id + " " + typ, log: logArgs, stored: stored}
	if f.term == nil {
		l := p.lease.leading.Load()
		if l == nil {
			p.log.DebugContext(ctx, "not leading: decision not sent", "decision", u.what)
			u.err = errNotSent
			endSpan(span)
			return u
		}
		if at := p.lease.renewed.Load(); at != nil {
			if age := time.Since(*at); age >= p.cfg.LeaseTTL {
				p.depose(l, "leader lease not renewed for "+age.Round(time.Millisecond).String())
				u.err = errNotSent
				endSpan(span)
				return u
			}
		}
	}
	// Each decision continues its own trace, whatever batch carries it:
	// its events carry the context of its publish span.
	pctx, pub := p.startPublish(ctx, events.SubjectOf(Source, aggregate, id, typ), events.EventSubject(aggregate, "{id}", typ),
		attribute.String(aggregate, id))
	u.pub = pub
	tr := nats.Header{}
	telemetry.Inject(pctx, tr)
	for i, d := range ds {
		d.Aggregate, d.ID, d.Expect, d.Trace = aggregate, id, nil, tr
		if i == 0 {
			d.Expect = expect
		}
		u.ds = append(u.ds, d)
	}
	p.fp.beforeDecision(p.log, f.send)
	key := aggregate + "." + id
	if f.open != nil && (f.open.keys[key] || f.open.n+len(u.ds) > batchDecisions) {
		f.send()
	}
	if f.open == nil {
		f.open = &batch{keys: map[string]bool{}}
	}
	f.open.units = append(f.open.units, u)
	f.open.n += len(u.ds)
	f.open.keys[key] = true
	return u
}

// send sends the open batch, if any, in the current leader term; with
// flightBatches batches in flight it first reads the oldest verdict.
func (f *flight) send() {
	b := f.open
	f.open = nil
	if b == nil {
		return
	}
	f.sendBatch(b)
}

func (f *flight) sendBatch(b *batch) {
	term := f.term
	if term == nil {
		l := f.p.lease.leading.Load()
		if l == nil {
			// Deposed since the units were added.
			for _, u := range b.units {
				u.err = errNotSent
				u.end(nil)
			}
			return
		}
		term = &l.term
	}
	if n := len(f.inFlight) - flightBatches + 1; n > 0 {
		f.settle(n)
	}
	ds := make([]bus.Decision, 0, b.n)
	for _, u := range b.units {
		ds = append(ds, u.ds...)
	}
	b.append = f.p.store.StartFenced(f.ctx, *term, ds...)
	f.inFlight = append(f.inFlight, b)
}

// command publishes a command of a stored decision. Its outcome is known
// once the flight settled.
func (f *flight) command(ctx context.Context, pc pending) *commandInFlight {
	pctx, span := f.p.startCommand(ctx, pc)
	if !trace.SpanFromContext(ctx).SpanContext().IsValid() {
		// A new root (see causedBy): a retry from the outbox continues
		// its trace.
		ctx = pctx
	}
	var ack jetstream.PubAckFuture
	var err error
	if pc.create != nil {
		ack, err = bus.StartCreate(pctx, f.p.conn, Source, *pc.create, 0)
	} else {
		pc.del.Reason = decide.Truncate(pc.del.Reason, 200)
		ack, err = bus.StartDelete(pctx, f.p.conn, Source, *pc.del, 0)
	}
	c := &commandInFlight{ctx: ctx, span: span, pc: pc, ack: ack, err: err}
	if err != nil {
		failSpan(span, err)
		f.keepCommand(ctx, pc, err)
		return c
	}
	f.commands = append(f.commands, c)
	if len(f.commands) >= 2*batchDecisions {
		f.settleCommands()
	}
	return c
}

// wait sends what is left and reads every verdict and acknowledgement
// still outstanding.
func (f *flight) wait() {
	f.send()
	for len(f.inFlight) > 0 || len(f.commands) > 0 {
		f.settle(len(f.inFlight))
		f.settleCommands()
	}
}

// settle reads the verdicts of the n oldest batches in flight. A stored
// batch's units send their commands; a refused batch of several units is
// sent again in two halves.
func (f *flight) settle(n int) {
	bs := f.inFlight[:n:n]
	f.inFlight = f.inFlight[n:]
	p := f.p
	for _, b := range bs {
		seq, err := b.append.Wait(f.ctx)
		switch {
		case err == nil:
			if f.rc != nil {
				// The reconciler's own decision: its next round waits
				// for the projection to hold it. (An intent's flight
				// runs on an API goroutine and touches no reconciler
				// state.)
				f.rc.noteOwn(seq)
			}
			// The batch's events are stored together, ending at seq.
			end := seq - uint64(b.n)
			for _, u := range b.units {
				end += uint64(len(u.ds))
				p.log.InfoContext(u.ctx, "decided", u.log...)
				for _, d := range u.ds {
					p.m.decided(u.ctx, d.Type, 1)
				}
				endSpan(u.pub)
				u.seq = end
				if u.stored != nil {
					u.stored(u.ctx, end)
				}
				endSpan(u.span)
			}
			continue
		case errors.Is(err, bus.ErrConflict) && len(b.units) > 1:
			// The halves are new appends: each unit's publish span
			// covers them all.
			half := len(b.units) / 2
			f.sendBatch(newBatch(b.units[:half]))
			f.sendBatch(newBatch(b.units[half:]))
			continue
		case errors.Is(err, bus.ErrFenced) && f.term != nil:
			// An intent fenced by a term that has just been superseded:
			// its caller reads the newer term and sends it again.
		case errors.Is(err, bus.ErrFenced):
			p.log.WarnContext(b.units[0].ctx, "decisions refused by the event log: a newer planner term has opened", "decisions", b.n)
			if l := p.lease.leading.Load(); l != nil {
				p.depose(l, "a decision was refused: a newer planner term has opened")
			}
		case errors.Is(err, bus.ErrConflict):
			p.log.DebugContext(b.units[0].ctx, "aggregate changed since it was read; deciding again next round", "decision", b.units[0].what)
		default:
			if f.ctx.Err() == nil {
				p.log.WarnContext(b.units[0].ctx, "append decisions", "decisions", b.n, "first", b.units[0].what, "err", err)
			}
		}
		for _, u := range b.units {
			f.unstored[u.pool] = true
			u.err = err
			if errors.Is(err, bus.ErrConflict) || f.ctx.Err() != nil {
				// Decided again from the newer state: not a failure.
				u.end(nil)
			} else {
				u.end(err)
			}
		}
	}
}

// end ends the unit's spans unsettled: err, if not nil, is why the
// decisions were not stored.
func (u *unit) end(err error) {
	if err != nil {
		failSpan(u.pub, err)
		failSpan(u.span, err)
		return
	}
	endSpan(u.pub)
	endSpan(u.span)
}

func newBatch(units []*unit) *batch {
	b := &batch{units: units, keys: map[string]bool{}}
	for _, u := range units {
		b.n += len(u.ds)
	}
	return b
}

// settleCommands reads the acknowledgements of the commands in flight; a
// command that failed is kept to be retried with the same Msg-Id.
func (f *flight) settleCommands() {
	cs := f.commands
	f.commands = nil
	deadline := time.NewTimer(commandTimeout)
	defer deadline.Stop()
	late := false
	for _, c := range cs {
		var err error
		if late {
			select {
			case <-c.ack.Ok():
			case err = <-c.ack.Err():
			default:
				err = fmt.Errorf("no acknowledgement within %s", commandTimeout)
			}
		} else {
			select {
			case <-c.ack.Ok():
			case err = <-c.ack.Err():
			case <-deadline.C:
				late = true
				err = fmt.Errorf("no acknowledgement within %s", commandTimeout)
			}
		}
		if err != nil {
			c.err = err
			failSpan(c.span, err)
			f.keepCommand(c.ctx, c.pc, err)
			continue
		}
		f.p.m.commands.Add(c.ctx, 1, metric.WithAttributes(attribute.String("verb", c.pc.verb())))
		c.span.End()
	}
}

// keep records a command whose publish failed, to retry it with the same
// Msg-Id next round.
// keepCommand hands a command whose publish failed to the reconciler's
// outbox; a flight outside the reconciler sends none.
func (f *flight) keepCommand(ctx context.Context, pc pending, err error) {
	if f.rc != nil {
		f.rc.keep(ctx, pc, err)
	}
}

func (rc *reconciler) keep(ctx context.Context, pc pending, err error) {
	if ctx.Err() != nil {
		return
	}
	id := ""
	if pc.create != nil {
		id = pc.create.ProxyID
	} else {
		id = pc.del.ProxyID
	}
	rc.log.WarnContext(ctx, "publish command failed; will retry", "proxy", id, "err", err)
	pc.trace = nats.Header{}
	telemetry.Inject(ctx, pc.trace)
	rc.outbox[id] = pc
}

func endSpan(s trace.Span) {
	if s != nil {
		s.End()
	}
}
