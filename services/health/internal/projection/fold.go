package projection

import (
	"cmp"
	"context"
	"errors"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// event is one FLEET_EVENTS message ready to be folded.
type event struct {
	seq           uint64
	subject       string
	agg, id, kind string
	by            events.Observer // the agent the subject names, if any
	env           events.Envelope
	header        nats.Header
	// fold is false for a message no view shows or that was refused
	// (already logged): it is only acknowledged.
	fold bool
	// invalid is the error of data that does not decode into the event's
	// type, for the proxy events whose data the fold does not decode
	// itself (requested, deleted, abandoned); the fold logs it unless the
	// event is a redelivery.
	invalid error
	// requested is the data of a proxy's requested event. Its Replaces is
	// read with the batch.
	requested *events.ProxyRequestedData
}

// prepare parses, decodes and checks one message, apart from the views.
// What it refuses is logged here, once, however often the batch is
// retried. [Projector.Run] and [Replay] prepare messages as they arrive,
// while the previous batch is written; nothing else may use p.rejects
// meanwhile.
func (p *Projector) prepare(seq uint64, subject string, data []byte, h nats.Header) event {
	ev := event{seq: seq, subject: subject, header: h}
	agg, id, kind, by, ok := events.ParseEventSubject(subject)
	if !ok {
		p.log.Error("event subject has the wrong shape; skipped", "seq", seq, "subject", subject)
		return ev
	}
	ev.agg, ev.id, ev.kind, ev.by = agg, id, kind, by
	if agg == events.AggregatePlanner {
		// Leader terms and decision fences: no view shows them.
		return ev
	}
	if err := bus.Expiring(subject, h); err != nil {
		p.log.Error("event that may expire; skipped", "seq", seq, "subject", subject, "err", err)
		return ev
	}
	env, err := events.DecodeEnvelope(data)
	if err != nil {
		p.log.Error("undecodable event; skipped", "seq", seq, "subject", subject, "err", err)
		return ev
	}
	if fe := events.CheckEvent(agg, id, kind, env.Source, by); fe != nil {
		p.rejects.Report(seq, agg, id, kind, env.Source, fe)
		return ev
	}
	if agg != events.AggregateProxy && agg != events.AggregatePool {
		p.log.Warn("event of an unknown aggregate; skipped", "seq", seq, "subject", subject)
		return ev
	}
	ev.env, ev.fold = env, true
	if agg == events.AggregateProxy {
		switch kind {
		case events.ProxyRequested:
			var d events.ProxyRequestedData
			if ev.invalid = env.DecodeData(&d); ev.invalid == nil {
				ev.requested = &d
			}
		case events.ProxyDeleted, events.ProxyAbandoned:
			ev.invalid = events.CheckProxyData(kind, env)
		}
		// The data of the other types is decoded by the fold, once:
		// ProxyView.Apply refuses what does not decode.
	} else {
		ev.invalid = events.CheckPoolData(kind, env)
	}
	return ev
}

// batch is the in-memory state of the keys a batch of events touches:
// each key is read once, every event of the batch is folded into it in
// stream order, and it is written once.
type batch struct {
	p       *Projector
	proxies map[string]*slot[Proxy]
	pools   map[string]*slot[Pool]
}

// errCrashed ends a batch the test hook [Projector.crash] stopped.
var errCrashed = errors.New("simulated crash")

// apply folds evs, in stream order, into the views and returns once every
// write is durable. On an error nothing is known of which writes landed:
// the cache is dropped and the caller applies the same events again, which
// is what a redelivery after a crash does too (see fold.noteReplacement).
func (p *Projector) apply(ctx context.Context, evs []event) error {
	b, err := p.newBatch(ctx)
	if err == nil {
		err = b.fold(ctx, evs)
	}
	if err == nil {
		err = b.write(ctx)
	}
	if err != nil {
		p.forget()
	}
	return err
}

// forget drops the cache of both buckets.
func (p *Projector) forget() {
	p.proxies.forget()
	p.pools.forget()
}

// newBatch starts a batch, checking the cache first (see [bucket]).
func (p *Projector) newBatch(ctx context.Context) (*batch, error) {
	if err := p.bind(); err != nil {
		return nil, err
	}
	if err := p.proxies.check(ctx, p.conn.JS); err != nil {
		return nil, err
	}
	if err := p.pools.check(ctx, p.conn.JS); err != nil {
		return nil, err
	}
	return &batch{p: p, proxies: map[string]*slot[Proxy]{}, pools: map[string]*slot[Pool]{}}, nil
}

// size is the number of keys in the batch.
func (b *batch) size() int { return len(b.proxies) + len(b.pools) }

// fold reads the keys evs touch that are not cached yet, and folds evs
// into the batch.
func (b *batch) fold(ctx context.Context, evs []event) error {
	p := b.p
	proxyKeys, poolKeys := map[string]struct{}{}, map[string]struct{}{}
	for i := range evs {
		switch ev := &evs[i]; {
		case !ev.fold:
		case ev.agg == events.AggregateProxy:
			proxyKeys[ev.id] = struct{}{}
			if ev.requested != nil && ev.requested.Replaces != "" {
				proxyKeys[ev.requested.Replaces] = struct{}{}
			}
		case ev.agg == events.AggregatePool:
			poolKeys[ev.id] = struct{}{}
		}
	}
	if err := p.proxies.load(ctx, p.conn.NC, proxyKeys); err != nil {
		return err
	}
	if err := p.pools.load(ctx, p.conn.NC, poolKeys); err != nil {
		return err
	}
	for i := range evs {
		ev := &evs[i]
		if !ev.fold {
			continue
		}
		switch ev.agg {
		case events.AggregateProxy:
			b.proxy(ev)
		case events.AggregatePool:
			if err := b.pool(ctx, ev); err != nil {
				return err
			}
		}
	}
	return nil
}

// write makes the batch durable, wave by wave, and keeps what it wrote in
// the cache.
func (b *batch) write(ctx context.Context) error {
	p := b.p
	waves := 0
	for _, s := range b.proxies {
		if s.dirty {
			waves = max(waves, s.wave+1)
		}
	}
	for w := range max(waves, 1) {
		ws, err := publish(p.js, p.proxies, b.proxies, w, nil, p.crash)
		if err == nil && w == 0 {
			ws, err = publish(p.js, p.pools, b.pools, w, ws, p.crash)
		}
		// The writes sent are awaited even when ctx ends meanwhile (a
		// projector stopping): one that returned first would unpin the
		// consumer while they are in flight, and the next projector's
		// newer writes of the same keys could be overtaken by them.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeDrain)
		werr := await(actx, ws)
		cancel()
		if err == nil {
			err = werr
		}
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			return err
		}
	}
	if p.crash != nil && p.crash(-1, "", "") {
		return errCrashed
	}
	p.proxies.keep(b.proxies)
	p.pools.keep(b.pools)
	return nil
}

// proxy folds one proxy event. It mirrors, per event, what the projection
// did one event at a time: the lifecycle table decides, a redelivered
// event changes nothing, a deleted proxy never comes back.
func (b *batch) proxy(ev *event) {
	s := b.p.proxies.slot(b.proxies, ev.id)
	seq, id, kind, env := ev.seq, ev.id, ev.kind, ev.env
	if s.exists && s.val.Seq >= seq {
		return // applied before: a redelivery
	}
	if ev.invalid != nil {
		b.logProxy(ev).Error("invalid event data; skipped", "err", ev.invalid)
		return
	}
	if s.exists {
		// An agent speaks only for the proxies placed on its entry and
		// target.
		if fe := events.CheckPlacement(ev.by, s.val.Entry, s.val.Target); fe != nil {
			b.p.misplaced.Report(seq, ev.agg, id, kind, env.Source, fe)
			return
		}
	}
	// The lifecycle is events.Transition, shared with the planner's fold. A
	// deleted or abandoned proxy has no key; its delete marker tells it from
	// a proxy never requested, and a terminal proxy absorbs everything.
	from := ""
	if s.exists {
		from = s.val.State
	} else if kind == events.ProxyRequested && s.ended {
		b.logProxy(ev).Debug("requested for a proxy that ended; skipped")
		return
	}
	to, ok := events.Transition(from, kind)
	if !ok {
		if err := events.CheckProxyData(kind, env); err != nil {
			b.logProxy(ev).Error("invalid event data; skipped", "err", err)
			return
		}
		// For example a probe that raced the planner's decision must not
		// make a retiring or failed proxy look serviceable again, and an
		// event for a missing key (an unhealthy observation racing the
		// deletion) must not resurrect a deleted proxy.
		b.logProxy(ev).Debug("event ignored in the proxy's state", "state", from)
		return
	}
	if kind == events.ProxyDeleted || kind == events.ProxyAbandoned {
		// The event kind alone is the fact: the proxy is gone.
		s.del()
		return
	}
	if kind == events.ProxyRequested && !s.exists {
		d := ev.requested
		b.noteReplacement(s, d.Replaces, id, d.ReplaceReason)
		s.put(events.NewProxyView(id, env.ID, seq, env.Time, *d))
		return
	}
	v := s.val
	if err := v.Apply(to, seq, kind, env); err != nil {
		b.logProxy(ev).Error("invalid event data; skipped", "err", err)
		return
	}
	s.put(v)
}

// noteReplacement records on proxy old that proxy by, being created in
// slot s, replaces it. It changes neither old's sequence nor its times:
// the fact belongs to by's requested event, and it is idempotent.
//
// The note is the one write that depends on another key, so it orders the
// batch's writes: by's key is written in a later wave than old's, and than
// any proxy that replaced old earlier in the batch. Were by durable and
// old not, a redelivered requested event would find by's key and skip,
// and the note would be lost; written in this order, any prefix of the
// waves that survives a crash is a state the redelivery completes into the
// views the events give one at a time.
func (b *batch) noteReplacement(s *slot[Proxy], old, by, why string) {
	if old == "" || old == by {
		return
	}
	o := b.p.proxies.slot(b.proxies, old)
	if !o.exists || (o.val.ReplacedBy == by && o.val.ReplaceReason == why) {
		return
	}
	v := o.val
	v.NoteReplacement(by, why)
	o.put(v)
	s.wave = max(s.wave, o.wave+1, o.noterWave+1)
	o.noterWave = s.wave
}

// pool folds one pool event.
func (b *batch) pool(ctx context.Context, ev *event) error {
	s := b.p.pools.slot(b.pools, ev.id)
	seq, name, kind, env := ev.seq, ev.id, ev.kind, ev.env
	if s.exists && s.val.Seq >= seq {
		return nil
	}
	if ev.invalid != nil {
		// Whatever its type: a deletion the planner cannot read does not
		// delete the pool here either.
		b.logPool(ev).Error("invalid event data; skipped", "err", ev.invalid)
		return nil
	}
	at := env.Time.UTC()
	switch kind {
	case events.PoolApplied:
		if !s.exists {
			if gone, err := b.p.endedLater(ctx, events.AggregatePool, name, seq); err != nil || gone {
				return err
			}
		}
		var d events.PoolAppliedData
		if err := env.DecodeData(&d); err != nil {
			b.logPool(ev).Error("invalid event data; skipped", "err", err)
			return nil
		}
		v := Pool{
			Name: cmp.Or(d.Spec.Name, name), Provider: d.Spec.Provider, Size: d.Spec.SizeAfterApply(nil, 0),
			Spec: d.Spec.Public(), Revision: d.Revision, SecretsDigest: d.SecretsDigest,
			CreatedAt: at, UpdatedAt: at, Seq: seq,
		}
		if s.exists {
			v.CreatedAt = s.val.CreatedAt
			v.Conditions = s.val.Conditions
			// The planner's rule: a re-apply of an autoscaled pool keeps
			// the size autoscaling reached, within the new bounds.
			v.Size = d.Spec.SizeAfterApply(&s.val.Spec, s.val.Size)
			if d.Spec.Autoscale != nil {
				v.ScaleReason, v.ScaledAt = s.val.ScaleReason, s.val.ScaledAt
			}
		}
		s.put(v)
	case events.PoolScaled:
		if !s.exists {
			return nil // a pool not in the view: nothing to size
		}
		var d events.PoolScaledData
		if err := env.DecodeData(&d); err != nil {
			b.logPool(ev).Error("invalid event data; skipped", "err", err)
			return nil
		}
		if s.val.Spec.Autoscale == nil {
			// The planner appends it expecting the pool's last event, so
			// it cannot follow an apply without autoscale; the planner's
			// fold ignores it too.
			b.logPool(ev).Warn("scaled event for a pool without autoscale; skipped")
			return nil
		}
		v := s.val
		v.Size = v.Spec.SizeAfterScaled(d.Size)
		v.ScaleReason, v.ScaledAt = d.Reason, at
		v.Seq = seq
		s.put(v)
	case events.PoolCondition:
		if !s.exists {
			// A condition of a pool that is not in the view (deleted, or its
			// applied event was skipped): nothing to annotate.
			return nil
		}
		var d events.PoolConditionData
		if err := env.DecodeData(&d); err != nil {
			b.logPool(ev).Error("invalid event data; skipped", "err", err)
			return nil
		}
		v := s.val
		v.Conditions = events.SetCondition(s.val.Conditions, d, at)
		v.Seq = seq
		s.put(v)
	case events.PoolDeleted:
		// A key holding a value that does not decode is removed too.
		if s.exists || s.rev != 0 && !s.ended {
			s.del()
		}
	default:
		b.logPool(ev).Warn("unknown pool event; skipped")
	}
	return nil
}

// endedLater reports whether the aggregate was deleted (or abandoned) by
// an event stored after seq. A creating event delivered again after its
// aggregate was deleted, and its key removed, must not bring the key back;
// the log knows it is gone. On a replay this skips aggregates that end
// deleted, which gives the same final views.
func (p *Projector) endedLater(ctx context.Context, aggregate, id string, seq uint64) (bool, error) {
	if p.stream == nil {
		st, err := p.conn.JS.Stream(ctx, bus.EventsStream)
		if err != nil {
			return false, err
		}
		p.stream = st
	}
	// An agent's deleted names the agent in its subject: any agent's
	// counts here, as the fold's placement check is not at hand.
	ends := []string{events.ObservationFilter(id, events.ProxyDeleted), events.EventSubject(aggregate, id, events.ProxyAbandoned)}
	if aggregate == events.AggregatePool {
		ends = []string{events.EventSubject(aggregate, id, events.PoolDeleted)}
	}
	for _, subject := range ends {
		raw, err := p.stream.GetLastMsgForSubject(ctx, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		if raw.Sequence > seq && readableEnd(raw.Subject, raw.Header, raw.Data) {
			return true, nil
		}
	}
	return false, nil
}

// readableEnd reports whether an event that would end an aggregate is one
// the fold would apply: its envelope and data decode and its writer may
// write it. An unreadable or forged deletion ends nothing.
func readableEnd(subject string, h nats.Header, data []byte) bool {
	agg, id, kind, by, ok := events.ParseEventSubject(subject)
	if !ok || bus.Expiring(subject, h) != nil {
		return false
	}
	env, err := events.DecodeEnvelope(data)
	if err != nil || events.CheckEvent(agg, id, kind, env.Source, by) != nil {
		return false
	}
	if agg == events.AggregatePool {
		return events.CheckPoolData(kind, env) == nil
	}
	return events.CheckProxyData(kind, env) == nil
}

// logProxy and logPool are the projection's loggers for one event, made
// only when there is something to log.
func (b *batch) logProxy(ev *event) *slog.Logger {
	return b.p.log.With("seq", ev.seq, "proxy", ev.id, "event", ev.kind)
}

func (b *batch) logPool(ev *event) *slog.Logger {
	return b.p.log.With("seq", ev.seq, "pool", ev.id, "event", ev.kind)
}
