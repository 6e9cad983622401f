// Package projection folds the FLEET_EVENTS log into the fleet-proxies and
// fleet-pools KV views. It reads through one durable consumer
// ("health-projection") and acknowledges each event after its KV writes.
//
// The views are a pure function of the log: values carry only event data
// and event times, each records the sequence of the last event applied so a
// redelivered event is skipped, and events are applied strictly in stream
// order (the consumer allows one unacknowledged event at a time). Dropping
// both buckets and the consumer and replaying, see [Rebuild], gives the same
// bytes.
package projection

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// ConsumerName is the durable consumer the projection reads FLEET_EVENTS with.
const ConsumerName = "health-projection"

// ackWait is how long an event may stay unacknowledged before it is
// redelivered. Retries of a failing KV write send InProgress meanwhile.
const ackWait = 30 * time.Second

// EnsureConsumer creates or updates the projection's durable consumer.
//
// MaxAckPending is 1 on purpose: a projection must apply events in stream
// order, and with more than one outstanding event a crash would let newer
// events through before the older unacknowledged ones are redelivered, which
// the per-key sequence check would then drop.
func EnsureConsumer(ctx context.Context, c *bus.Conn) (jetstream.Consumer, error) {
	return c.JS.CreateOrUpdateConsumer(ctx, bus.EventsStream, jetstream.ConsumerConfig{
		Durable:       ConsumerName,
		Description:   "health: projection of FLEET_EVENTS into fleet-proxies and fleet-pools",
		FilterSubject: events.EventsAll,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxAckPending: 1,
		// Replicas 0: the consumer follows the stream's replica count.
	})
}

// Rebuild drops the projection's consumer and both view buckets, then
// recreates the buckets empty. The next [Projector.Run] replays the whole
// log into them. Other health instances should be stopped first; a running
// one recreates the consumer and carries on.
func Rebuild(ctx context.Context, c *bus.Conn) error {
	if err := c.JS.DeleteConsumer(ctx, bus.EventsStream, ConsumerName); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("delete consumer %s: %w", ConsumerName, err)
	}
	for _, b := range []string{bus.BucketProxies, bus.BucketPools} {
		if err := c.JS.DeleteKeyValue(ctx, b); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
			return fmt.Errorf("delete bucket %s: %w", b, err)
		}
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		return fmt.Errorf("recreate buckets: %w", err)
	}
	return nil
}

// Projector applies events to the views.
//
// A Projector is not safe for concurrent use: events must be applied one at
// a time, in order.
type Projector struct {
	conn    *bus.Conn
	log     *slog.Logger
	tracer  trace.Tracer
	applied metric.Int64Counter

	proxies, pools jetstream.KeyValue // bound on first use
	stream         jetstream.Stream
	proxiesStream  jetstream.Stream // the stream behind the proxies bucket
	rejects        *bus.Rejects
}

// New returns a projector writing through c. log and tel may be nil.
func New(c *bus.Conn, log *slog.Logger, tel *telemetry.Telemetry) *Projector {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tracer, meter := trace.Tracer(tracenoop.NewTracerProvider().Tracer("")), metric.Meter(metricnoop.NewMeterProvider().Meter(""))
	if tel != nil {
		tracer, meter = tel.Tracer, tel.Meter
	}
	applied, _ := meter.Int64Counter("proxyfleet.health.projection.events",
		metric.WithDescription("events read by the projection, by aggregate"))
	log = log.With("component", "projection")
	return &Projector{conn: c, log: log, tracer: tracer, applied: applied, rejects: bus.NewRejects(log, 0)}
}

// Run consumes FLEET_EVENTS until ctx ends. A lost consumer (deleted by a
// rebuild, or a NATS outage) is recreated after a short pause.
func (p *Projector) Run(ctx context.Context) error {
	return p.run(ctx, 0)
}

// Replay drops the views and the consumer (see [Rebuild]) and projects the
// whole log into them again, returning once every event stored when it
// started has been applied.
func Replay(ctx context.Context, c *bus.Conn, log *slog.Logger) error {
	if err := Rebuild(ctx, c); err != nil {
		return err
	}
	st, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		return err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return err
	}
	if info.State.LastSeq == 0 {
		return nil
	}
	return New(c, log, nil).run(ctx, info.State.LastSeq)
}

// errReached ends a consume loop that was asked to stop at a sequence.
var errReached = errors.New("reached the requested sequence")

// run consumes until ctx ends or, with until > 0, until the event at
// sequence until is applied.
func (p *Projector) run(ctx context.Context, until uint64) error {
	for {
		err := p.consume(ctx, until)
		if errors.Is(err, errReached) {
			return nil
		}
		if ctx.Err() != nil {
			if until > 0 {
				return ctx.Err()
			}
			return nil
		}
		p.log.Warn("projection consumer stopped; restarting it", "err", err)
		select {
		case <-ctx.Done():
			if until > 0 {
				return ctx.Err()
			}
			return nil
		case <-time.After(time.Second):
		}
	}
}

func (p *Projector) consume(ctx context.Context, until uint64) error {
	p.proxies, p.pools, p.stream, p.proxiesStream = nil, nil, nil, nil
	cons, err := EnsureConsumer(ctx, p.conn)
	if err != nil {
		return fmt.Errorf("consumer %s: %w", ConsumerName, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	defer it.Stop()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return err
		}
		md, err := msg.Metadata()
		if err != nil {
			p.log.Error("event without JetStream metadata; skipped", "subject", msg.Subject(), "err", err)
			_ = msg.Term()
			continue
		}
		seq := md.Sequence.Stream
		// The projection joins the trace of whoever appended the event.
		sctx, span := p.tracer.Start(telemetry.Extract(ctx, msg.Headers()), "health.project",
			trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(attribute.String("subject", msg.Subject()), attribute.Int64("seq", int64(seq))))
		err = p.applyRetrying(sctx, msg, seq)
		span.End()
		if err != nil {
			return err
		}
		agg, _, _, _ := events.ParseEventSubject(msg.Subject())
		p.applied.Add(ctx, 1, metric.WithAttributes(attribute.String("aggregate", agg)))
		if until > 0 && seq >= until {
			// Confirmed, so the caller may exit right away.
			if err := msg.DoubleAck(ctx); err != nil {
				return err
			}
			return errReached
		}
		if err := msg.Ack(); err != nil {
			// The event comes back after ackWait and is skipped by its sequence.
			p.log.Warn("ack failed", "seq", seq, "err", err)
		}
	}
}

// applyRetrying applies one event, retrying KV failures in place (never
// moving on: order matters) until they succeed or ctx ends.
func (p *Projector) applyRetrying(ctx context.Context, msg jetstream.Msg, seq uint64) error {
	delay := 100 * time.Millisecond
	for {
		err := p.Apply(ctx, seq, msg.Subject(), msg.Data())
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.log.Warn("applying event failed; retrying", "seq", seq, "subject", msg.Subject(), "in", delay.String(), "err", err)
		_ = msg.InProgress()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 5*time.Second)
	}
}

// Apply folds the event stored at sequence seq on subject into the views.
// It returns an error only when a KV operation failed (the caller retries);
// events it cannot decode or does not know are logged and skipped.
func (p *Projector) Apply(ctx context.Context, seq uint64, subject string, data []byte) error {
	agg, id, kind, ok := events.ParseEventSubject(subject)
	if !ok {
		p.log.Error("event subject has the wrong shape; skipped", "seq", seq, "subject", subject)
		return nil
	}
	if agg == events.AggregatePlanner {
		// Leader terms and decision fences: no view shows them.
		return nil
	}
	env, err := events.DecodeEnvelope(data)
	if err != nil {
		p.log.Error("undecodable event; skipped", "seq", seq, "subject", subject, "err", err)
		return nil
	}
	if fe := events.CheckEvent(agg, id, kind, env.Source); fe != nil {
		p.rejects.Report(seq, agg, id, kind, env.Source, fe)
		return nil
	}
	switch agg {
	case events.AggregateProxy:
		return p.applyProxy(ctx, seq, id, kind, env)
	case events.AggregatePool:
		return p.applyPool(ctx, seq, id, kind, env)
	}
	p.log.Warn("event of an unknown aggregate; skipped", "seq", seq, "subject", subject)
	return nil
}

func (p *Projector) applyProxy(ctx context.Context, seq uint64, id, kind string, env events.Envelope) error {
	kv, err := p.bucket(ctx, &p.proxies, bus.BucketProxies)
	if err != nil {
		return err
	}
	log := p.log.With("seq", seq, "proxy", id, "event", kind)
	cur, exists, err := load[Proxy](ctx, kv, id, log)
	if err != nil {
		return err
	}
	if exists && cur.Seq >= seq {
		return nil // applied before: a redelivery
	}
	skip := func(err error) error {
		log.Error("invalid event data; skipped", "err", err)
		return nil
	}
	if err := events.CheckProxyData(kind, env); err != nil {
		return skip(err)
	}
	// The lifecycle is events.Transition, shared with the planner's fold. A
	// deleted or abandoned proxy has no key; its delete marker tells it from
	// a proxy never requested, and a terminal proxy absorbs everything.
	from := ""
	if exists {
		from = cur.State
	} else if kind == events.ProxyRequested {
		ended, err := p.ended(ctx, id)
		if err != nil {
			return err
		}
		if ended {
			log.Debug("requested for a proxy that ended; skipped")
			return nil
		}
	}
	to, ok := events.Transition(from, kind)
	if !ok {
		// For example a probe that raced the planner's decision must not
		// make a retiring or failed proxy look serviceable again, and an
		// event for a missing key (an unhealthy observation racing the
		// deletion) must not resurrect a deleted proxy.
		log.Debug("event ignored in the proxy's state", "state", from)
		return nil
	}
	if kind == events.ProxyDeleted || kind == events.ProxyAbandoned {
		// The event kind alone is the fact: the proxy is gone.
		if err := kv.Delete(ctx, id); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			return err
		}
		return nil
	}
	if kind == events.ProxyRequested && !exists {
		var d events.ProxyRequestedData
		if err := env.DecodeData(&d); err != nil {
			return skip(err)
		}
		// The replaced proxy first: if this fails or the process dies, the
		// event is delivered again and finds no key for this proxy yet.
		if err := p.noteReplacement(ctx, kv, d.Replaces, id, d.ReplaceReason, log); err != nil {
			return err
		}
		return put(ctx, kv, id, events.NewProxyView(id, env.ID, seq, env.Time, d))
	}
	v := cur
	if err := v.Apply(to, seq, kind, env); err != nil {
		return skip(err)
	}
	return put(ctx, kv, id, v)
}

// noteReplacement records on proxy old that proxy by replaces it. It is
// idempotent and changes neither old's sequence nor its times: the fact
// belongs to by's requested event.
func (p *Projector) noteReplacement(ctx context.Context, kv jetstream.KeyValue, old, by, why string, log *slog.Logger) error {
	if old == "" || old == by {
		return nil
	}
	v, exists, err := load[Proxy](ctx, kv, old, log)
	if err != nil || !exists || (v.ReplacedBy == by && v.ReplaceReason == why) {
		return err
	}
	v.NoteReplacement(by, why)
	return put(ctx, kv, old, v)
}

// ended reports whether the proxy's key was deleted: the projection applied
// its deleted or abandoned event. The key's delete marker stays in the
// bucket (History 1, no TTL) and is rebuilt by a replay in log order.
func (p *Projector) ended(ctx context.Context, id string) (bool, error) {
	if p.proxiesStream == nil {
		st, err := p.conn.JS.Stream(ctx, "KV_"+bus.BucketProxies)
		if err != nil {
			return false, err
		}
		p.proxiesStream = st
	}
	raw, err := p.proxiesStream.GetLastMsgForSubject(ctx, "$KV."+bus.BucketProxies+"."+id)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	// The KV protocol marks deletes and purges with this header.
	switch raw.Header.Get("KV-Operation") {
	case "DEL", "PURGE":
		return true, nil
	}
	return false, nil
}

func (p *Projector) applyPool(ctx context.Context, seq uint64, name, kind string, env events.Envelope) error {
	kv, err := p.bucket(ctx, &p.pools, bus.BucketPools)
	if err != nil {
		return err
	}
	log := p.log.With("seq", seq, "pool", name, "event", kind)
	cur, exists, err := load[Pool](ctx, kv, name, log)
	if err != nil {
		return err
	}
	if exists && cur.Seq >= seq {
		return nil
	}
	at := env.Time.UTC()
	switch kind {
	case events.PoolApplied:
		if !exists {
			if gone, err := p.endedLater(ctx, events.AggregatePool, name, seq); err != nil || gone {
				return err
			}
		}
		var d events.PoolAppliedData
		if err := env.DecodeData(&d); err != nil {
			log.Error("invalid event data; skipped", "err", err)
			return nil
		}
		v := Pool{
			Name: cmp.Or(d.Spec.Name, name), Provider: d.Spec.Provider, Size: d.Spec.Size,
			Spec: d.Spec.Public(), Revision: d.Revision, SecretsDigest: d.SecretsDigest,
			CreatedAt: at, UpdatedAt: at, Seq: seq,
		}
		if exists {
			v.CreatedAt = cur.CreatedAt
			v.Conditions = cur.Conditions
		}
		return put(ctx, kv, name, v)
	case events.PoolCondition:
		if !exists {
			// A condition of a pool that is not in the view (deleted, or its
			// applied event was skipped): nothing to annotate.
			return nil
		}
		var d events.PoolConditionData
		if err := env.DecodeData(&d); err != nil {
			log.Error("invalid event data; skipped", "err", err)
			return nil
		}
		v := cur
		v.Conditions = events.SetCondition(cur.Conditions, d, at)
		v.Seq = seq
		return put(ctx, kv, name, v)
	case events.PoolDeleted:
		if err := kv.Delete(ctx, name); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			return err
		}
		return nil
	}
	log.Warn("unknown pool event; skipped")
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
	ends := []string{events.ProxyDeleted, events.ProxyAbandoned}
	if aggregate == events.AggregatePool {
		ends = []string{events.PoolDeleted}
	}
	for _, kind := range ends {
		raw, err := p.stream.GetLastMsgForSubject(ctx, events.EventSubject(aggregate, id, kind))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		if raw.Sequence > seq {
			return true, nil
		}
	}
	return false, nil
}

func (p *Projector) bucket(ctx context.Context, h *jetstream.KeyValue, name string) (jetstream.KeyValue, error) {
	if *h == nil {
		kv, err := p.conn.JS.KeyValue(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("bucket %s: %w", name, err)
		}
		*h = kv
	}
	return *h, nil
}

// load reads and decodes key. A value that does not decode is reported and
// treated as absent, so the next creating event replaces it.
func load[T any](ctx context.Context, kv jetstream.KeyValue, key string, log *slog.Logger) (T, bool, error) {
	var v T
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return v, false, nil
	}
	if err != nil {
		return v, false, err
	}
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		log.Error("stored view value does not decode; treating it as absent", "err", err)
		var zero T
		return zero, false, nil
	}
	return v, true, nil
}

func put(ctx context.Context, kv jetstream.KeyValue, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = kv.Put(ctx, key, b)
	return err
}
