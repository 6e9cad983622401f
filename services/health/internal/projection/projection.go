// Package projection folds the FLEET_EVENTS log into the fleet-proxies and
// fleet-pools KV views. It follows the log through one durable consumer
// ("health-projection") and acknowledges events once their KV writes are
// durable; a rebuild ([Replay]) reads it with an ordered consumer.
//
// The views are a pure function of the log: values carry only event data
// and event times, each records the sequence of the last event applied so a
// redelivered event is skipped, and events are applied in stream order.
// Events are applied in batches: every key a batch touches is read once,
// every event of the batch is folded into it in order, and it is written
// once, the writes pipelined; the batch is acknowledged when they are all
// durable. Dropping both buckets and the consumer and replaying, see
// [Rebuild] and [Replay], gives the same bytes as applying the log one
// event at a time.
package projection

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
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
const ConsumerName = bus.HealthProjection

// PriorityGroup is the consumer's one priority group: the projection pulls
// as a pinned client of it.
const PriorityGroup = bus.HealthProjectionGroup

const (
	// pullExpiry is how long one pull request waits; a pinned projector
	// renews its pin with every pull, so it is well below
	// bus.HealthProjectionPinnedTTL.
	pullExpiry = 5 * time.Second
	// maxAckPending bounds the events delivered and not yet acknowledged:
	// the batch being applied and the next one, prefetched meanwhile.
	maxAckPending = bus.HealthProjectionMaxAckPending
	// writeDrain bounds how long a stopping projector waits for the view
	// writes it sent to be acknowledged.
	writeDrain = 10 * time.Second
	// batchLimit bounds the events of one batch of [Projector.Run].
	batchLimit = 2048
	// replayKeyLimit bounds the keys of one batch of [Replay], which owns
	// the views: the more events a batch folds, the more of them each key
	// write covers.
	replayKeyLimit = 32768
	// replayChunk is how many events [Replay] prepares and folds at a
	// time, and replayAhead how many it prepares while it writes.
	replayChunk = 4096
	replayAhead = 4 * replayChunk
	// writeTimeout bounds the wait for the acknowledgement of a KV write.
	writeTimeout = 10 * time.Second
	// stopWait bounds how long a stopped pull waits for its unsubscribe to
	// reach the server.
	stopWait = 5 * time.Second
	// stopPoll is how often a stopped pull checks that it unsubscribed.
	stopPoll = 5 * time.Millisecond
	// stallAfter is how long a pinned projector may receive nothing while
	// the consumer has events for it (not delivered yet, or delivered and
	// not acknowledged) before it counts as stalled and gives the pin up
	// (see [Projector.receive]). A working projector gets every such
	// event within bus.HealthProjectionAckWait (a delivery it lost comes
	// again then), and its pull requests are renewed every pullExpiry, so
	// past both nothing legitimate is still on its way.
	stallAfter = bus.HealthProjectionAckWait + pullExpiry
	// stallCheck is how often a waiting projector looks at the time since
	// its last delivery.
	stallCheck = time.Second
)

// errStalled ends [Projector.follow] when the projector holds the pin and
// receives nothing although the consumer has events for it.
var errStalled = errors.New("pinned to this projector, which receives nothing of the events waiting; giving the consumer up")

// pinHeader names the pin of the projector a message was delivered to.
const pinHeader = "Nats-Pin-Id"

// EnsureConsumer creates or updates the projection's durable consumer (or
// binds it, on a connection that may not create it).
//
// A projection must apply events in stream order, and one projector at a
// time: with two, or with newer events delivered before older ones that a
// crashed projector held unacknowledged, a newer event would reach a key
// first and the per-key sequence check would then drop the older one. So
// the consumer pins one projector (PriorityPolicy pinned_client), and a
// projector, whenever it gets the pin, first resets the consumer to its
// acknowledgement floor: everything not acknowledged is delivered again,
// in order. Up to MaxAckPending events are in flight to the pinned
// projector, which applies them in batches and acknowledges a batch once
// its writes are durable.
func EnsureConsumer(ctx context.Context, c *bus.Conn) (jetstream.Consumer, error) {
	if !c.MayCreate() {
		// Under deploy/nats health may not create it: the bootstrap did.
		return bus.BindConsumer(ctx, c, bus.EventsStream, ConsumerName)
	}
	return c.JS.CreateOrUpdateConsumer(ctx, bus.EventsStream, bus.HealthProjectionConfig())
}

// The consumer's limits are defined with it in pkg/bus; the projection
// batches depend on them.
var _ = [1]struct{}{}[maxAckPending-2*batchLimit]

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
// A Projector is not safe for concurrent use: events must be applied in
// order, one batch at a time.
type Projector struct {
	conn    *bus.Conn
	log     *slog.Logger
	tracer  trace.Tracer
	meter   metric.Meter
	applied metric.Int64Counter
	// statsEvery is how often Run reads the consumer's backlog and the
	// log's last sequence for the gauges.
	statsEvery time.Duration
	rejects    *bus.Rejects
	// misplaced reports observations by an agent other than the one a
	// proxy was placed on; the fold uses it, prepare uses rejects.
	misplaced *bus.Rejects

	// behind: the events waiting to be applied after the last batch were
	// a batch's worth or more (see [Projector.Behind]).
	behind atomic.Bool

	js      jetstream.JetStream // pipelined KV writes, bound on first use
	stream  jetstream.Stream    // FLEET_EVENTS, bound on first use
	proxies *bucket[Proxy]
	pools   *bucket[Pool]

	// replayKeys bounds the keys of one batch of a replay: replayKeyLimit
	// but in tests.
	replayKeys int
	// stallAfter is stallAfter but in tests.
	stallAfter time.Duration

	// deaf, a test hook, simulates deliveries that never reach the
	// projector while its pull requests go on (and renew its pin): while
	// it returns true, every message pulled is dropped unseen.
	deaf func() bool

	// crash, a test hook, simulates the process dying in a batch: it is
	// asked about every KV write (wave, bucket, key), and once (-1, "",
	// "") when the writes are durable and the batch about to be
	// acknowledged; true drops that write, or the acknowledgements, and
	// fails the batch with errCrashed, which ends [Projector.Run] (a
	// replay reads the batch again).
	crash func(wave int, bucket, key string) bool
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
	applied, _ := meter.Int64Counter("proxyfleet_health_projection_events_total",
		metric.WithDescription("Events folded into the views, by aggregate."))
	log = log.With("component", "projection")
	return &Projector{
		conn: c, log: log, tracer: tracer, meter: meter, applied: applied, statsEvery: bus.ConsumerMetricsInterval, rejects: bus.NewRejects(log, 0), misplaced: bus.NewRejects(log, 0),
		proxies: newBucket[Proxy](bus.BucketProxies, log), pools: newBucket[Pool](bus.BucketPools, log),
		replayKeys: replayKeyLimit, stallAfter: stallAfter,
	}
}

func (p *Projector) bind() error {
	if p.js != nil {
		return nil
	}
	// A JetStream context of its own: its pending acknowledgements are the
	// projection's alone, and they time out.
	js, err := jetstream.New(p.conn.NC,
		jetstream.WithPublishAsyncMaxPending(2*replayKeyLimit),
		jetstream.WithPublishAsyncTimeout(writeTimeout))
	if err != nil {
		return err
	}
	p.js = js
	return nil
}

// behindAt is the number of events delivered and waiting after a batch
// from which the projection counts as behind the log.
const behindAt = batchLimit / 4

// Behind reports whether the projection is behind the log: after its last
// batch, events enough for a quarter of a batch or more were waiting. The
// health service's prober probes less meanwhile (see probe.Config.Behind):
// the views are what every service reads, and probing through proxies the
// views do not show yet would only slow them down further.
func (p *Projector) Behind() bool { return p.behind.Load() }

// Run consumes FLEET_EVENTS until ctx ends. A lost consumer (deleted by a
// rebuild, or a NATS outage) is recreated after a short pause. Meanwhile
// it reports the consumer's backlog and the projection's lag (see
// [Projector.followLag]).
func (p *Projector) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { p.followLag(ctx) })
	for {
		err := p.follow(ctx)
		if errors.Is(err, errCrashed) {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		p.log.Warn("projection consumer stopped; restarting it", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// follow applies events from the durable consumer until ctx ends or the
// consumer fails.
func (p *Projector) follow(ctx context.Context) (err error) {
	p.proxies.forget()
	p.pools.forget()
	cons, err := EnsureConsumer(ctx, p.conn)
	if err != nil {
		return fmt.Errorf("consumer %s: %w", ConsumerName, err)
	}
	// Unless another projector holds the consumer, deliver at once what a
	// projector before this one (this process, before a restart) left
	// unacknowledged: the server would otherwise wait ackWait before
	// delivering it, and deliver nothing else meanwhile if it filled
	// MaxAckPending.
	info, err := cons.Info(ctx)
	if err != nil {
		return fmt.Errorf("consumer %s: %w", ConsumerName, err)
	}
	var holder string
	if len(info.PriorityGroups) > 0 {
		holder = info.PriorityGroups[0].PinnedClientID
	}
	p.log.Debug("following the consumer", "pinned_to", holder, "ack_floor", info.AckFloor.Stream, "pending", info.NumPending)
	if holder == "" {
		if _, err := p.reset(ctx); err != nil {
			return err
		}
	}
	var (
		src  *source
		pin  string // the pin this projector holds, once it reset the consumer
		seen string // the pin of the last message pulled
		// next is the consumer (delivery) sequence the next message
		// delivered under pin must carry, from the last reset on.
		next uint64
		// last is when this projector last received a delivery,
		// applied a batch, or pulled afresh (see [Projector.receive]).
		last = time.Now()
	)
	defer func() {
		if src != nil {
			seen = cmp.Or(src.stop(), seen)
		}
		if seen != "" && !errors.Is(err, errCrashed) {
			p.unpin(ctx, cons, seen)
		}
	}()
	for {
		if src == nil {
			it, err := cons.Messages(jetstream.PullPriorityGroup(PriorityGroup),
				jetstream.PullMaxMessages(maxAckPending), jetstream.PullExpiry(pullExpiry))
			if err != nil {
				return err
			}
			src = newSource(p, it, pin, maxAckPending)
		}
		b, err := p.receive(ctx, cons, src, pin, &last)
		if err != nil {
			return err
		}
		gap, follows := b.follows(next)
		switch {
		case b.pin != pin:
			// This projector just got the pin: whatever a projector before
			// it left unacknowledged must come first.
			p.log.Debug("consumer pinned to this projector; delivering from the acknowledgement floor", "pin", b.pin)
		case !follows:
			// Some deliveries since the last reset did not reach this
			// projector: taken by pull requests of a stopped iterator
			// that the server had not dropped yet, or lost in a
			// reconnection. Applying what follows them would put newer
			// events of a key before older ones, which come back after
			// ackWait and are skipped as already applied: lost. (Another
			// projector's reset shows up the same way.)
			p.log.Warn("deliveries to this projector have a gap; delivering again from the acknowledgement floor", "want_delivery", next, "got_delivery", gap)
		default:
			next += uint64(b.n)
			if err := p.applyBatch(ctx, b, true); err != nil {
				return err
			}
			// A batch that took long to apply (its writes retried)
			// is progress too: the stall check counts from here.
			last = time.Now()
			p.behind.Store(len(src.in) >= behindAt)
			continue
		}
		// Stop pulling (the messages in flight are dropped with the
		// subscription), wait until the server has forgotten the pull
		// requests, reset the consumer to its acknowledgement floor, and
		// pull again.
		seen = cmp.Or(src.stop(), seen)
		src.forgotten()
		src = nil
		first, err := p.reset(ctx)
		if err != nil {
			return err
		}
		pin, next, last = b.pin, first, time.Now()
		p.log.Debug("consumer reset to its acknowledgement floor; pulling again", "pin", pin, "first_delivery", first)
		p.proxies.forget()
		p.pools.forget()
	}
}

// receive returns the next batch of src. While it waits it checks, every
// stallCheck, whether this projector holds the pin (pin, set once it
// reset the consumer) and has received nothing for stallAfter although
// the consumer has events for it: it then returns errStalled, and
// [Projector.follow]'s return unpins the consumer so another projector
// takes over. Without this, a projector whose pull requests go on
// (renewing the pin, and answered by heartbeats, so its iterator reports
// no error) while no delivery reaches it would keep the pin, and the
// views would stay where they are, for as long as it runs.
func (p *Projector) receive(ctx context.Context, cons jetstream.Consumer, src *source, pin string, last *time.Time) (*batchIn, error) {
	for {
		wctx, cancel := context.WithTimeout(ctx, stallCheck)
		b, err := src.next(wctx, batchLimit, 0)
		cancel()
		if err == nil {
			*last = time.Now()
			return b, nil
		}
		if ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return nil, err
		}
		if pin == "" || time.Since(*last) < p.stallAfter {
			continue
		}
		ictx, icancel := context.WithTimeout(ctx, stopWait)
		info, err := cons.Info(ictx)
		icancel()
		if err != nil {
			// The iterator's heartbeats tell whether the server is
			// still there; ask again at the next check.
			p.log.Debug("no delivery for a while and the consumer cannot be read", "for", time.Since(*last).Round(time.Second).String(), "err", err)
			continue
		}
		if len(info.PriorityGroups) == 0 || info.PriorityGroups[0].PinnedClientID != pin ||
			(info.NumPending == 0 && info.NumAckPending == 0) {
			continue // idle, or no longer this projector's
		}
		return nil, fmt.Errorf("%w (no delivery for %s; %d events not delivered, %d unacknowledged)",
			errStalled, time.Since(*last).Round(time.Second), info.NumPending, info.NumAckPending)
	}
}

// reset makes the consumer deliver again, in order, every event from its
// acknowledgement floor on. It returns the consumer (delivery) sequence
// the first of those deliveries carries: the server restarts them at 1.
func (p *Projector) reset(ctx context.Context) (uint64, error) {
	r, err := p.conn.JS.ResetConsumer(ctx, bus.EventsStream, ConsumerName)
	if err != nil {
		return 0, fmt.Errorf("reset consumer %s to its acknowledgement floor (needs nats-server 2.14 or later): %w", ConsumerName, err)
	}
	if r.ConsumerInfo == nil {
		return 1, nil
	}
	return r.Delivered.Consumer + 1, nil
}

// unpin hands the consumer over at once to the next projector, if this
// one still holds it.
func (p *Projector) unpin(ctx context.Context, cons jetstream.Consumer, pin string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	info, err := cons.Info(ctx)
	if err != nil || len(info.PriorityGroups) == 0 || info.PriorityGroups[0].PinnedClientID != pin {
		return
	}
	st, err := p.conn.JS.Stream(ctx, bus.EventsStream)
	if err == nil {
		err = st.UnpinConsumer(ctx, ConsumerName, PriorityGroup)
	}
	if err != nil {
		p.log.Debug("unpin failed; the next projector waits for the pin to expire", "err", err)
	}
}

// Replay drops the views and the consumer (see [Rebuild]) and projects the
// whole log into them again, returning once every event stored when it
// started has been applied. The consumer is then created to deliver the
// events after those.
//
// Replay reads the log with an ordered consumer: it owns the views (other
// health instances are stopped first), so it needs no acknowledgements,
// and its batches are larger. Events are folded and written as
// [Projector.Run] does.
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
	until := info.State.LastSeq
	if until == 0 {
		return nil
	}
	return New(c, log, nil).replayAll(ctx, st, until)
}

// replayAll applies the log up to until into empty views, then positions
// the consumer after it.
func (p *Projector) replayAll(ctx context.Context, st jetstream.Stream, until uint64) error {
	c := p.conn
	if err := p.replay(ctx, st, until); err != nil {
		return err
	}
	// A crash before this line leaves no consumer: the next health
	// creates it and replays the log again, changing nothing.
	if _, err := EnsureConsumer(ctx, c); err != nil {
		return fmt.Errorf("consumer %s: %w", ConsumerName, err)
	}
	if _, err := c.JS.ResetConsumerToSequence(ctx, bus.EventsStream, ConsumerName, until+1); err != nil {
		return fmt.Errorf("position consumer %s after the replayed events: %w", ConsumerName, err)
	}
	return nil
}

// replay applies the log from its start to the event at until, retrying
// in place what fails.
func (p *Projector) replay(ctx context.Context, st jetstream.Stream, until uint64) error {
	from, delay := uint64(1), 100*time.Millisecond
	for {
		next, err := p.replayFrom(ctx, st, from, until)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if next > from {
			delay = 100 * time.Millisecond
		}
		from = next
		p.log.Warn("replaying events failed; reading them again", "from_seq", from, "in", delay.String(), "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 5*time.Second)
	}
}

// replayFrom reads the log from sequence from on, folding it into batches
// of up to replayKeyLimit keys (and a chunk), each written when full; the events are not
// kept, so a batch may cover many more events than [Projector.Run] holds at
// once. On an error it returns the first sequence of the batch that failed:
// the events are read again from there.
func (p *Projector) replayFrom(ctx context.Context, st jetstream.Stream, from, until uint64) (uint64, error) {
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{events.EventsAll}, DeliverPolicy: jetstream.DeliverAllPolicy}
	if from > 1 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from
	}
	oc, err := st.OrderedConsumer(ctx, cfg)
	if err != nil {
		return from, err
	}
	it, err := oc.Messages(jetstream.PullMaxMessages(maxAckPending))
	if err != nil {
		return from, err
	}
	src := newSource(p, it, "", replayAhead)
	defer src.stop()
	for {
		b, err := p.replayBatch(ctx, src, until)
		if err != nil {
			p.forget()
			return from, err
		}
		if b.done {
			return 0, nil
		}
		from = b.next
	}
}

// replayed is the outcome of one batch of a replay.
type replayed struct {
	next uint64 // the sequence after the batch's last event
	done bool   // the batch ended at the event wanted last
}

func (p *Projector) replayBatch(ctx context.Context, src *source, until uint64) (replayed, error) {
	var r replayed
	b, err := p.newBatch(ctx)
	if err != nil {
		return r, err
	}
	counts := map[string]int64{}
	for !r.done && b.size() < p.replayKeys {
		in, err := src.next(ctx, min(replayChunk, p.replayKeys), until)
		if err != nil {
			return r, err
		}
		for _, m := range in.bad {
			p.log.Error("event without JetStream metadata; skipped", "subject", m.Subject())
		}
		if err := b.fold(ctx, in.evs); err != nil {
			return r, err
		}
		for i := range in.evs {
			counts[in.evs[i].agg]++
			r.next = in.evs[i].seq + 1
		}
		r.done = in.last
	}
	if err := b.write(ctx); err != nil {
		return r, err
	}
	for agg, n := range counts {
		p.applied.Add(ctx, n, metric.WithAttributes(attribute.String("aggregate", agg)))
	}
	return r, nil
}

// Apply folds the event stored at sequence seq on subject into the views,
// as a batch of one. It returns an error only when a KV operation failed
// (the caller retries); events it cannot decode or does not know are
// logged and skipped.
func (p *Projector) Apply(ctx context.Context, seq uint64, subject string, data []byte) error {
	return p.apply(ctx, []event{p.prepare(seq, subject, data, nil)})
}

// applyBatch applies one batch of messages, retrying in place (never
// moving on: order matters) until it succeeds or ctx ends, then
// acknowledges it when ack is set.
func (p *Projector) applyBatch(ctx context.Context, b *batchIn, ack bool) error {
	for _, m := range b.bad {
		p.log.Error("event without JetStream metadata; skipped", "subject", m.Subject())
		if ack {
			_ = m.Term()
		}
	}
	evs := b.evs
	if len(evs) == 0 {
		return nil
	}
	msgs := b.msgs
	if !ack {
		msgs = nil
	}
	// One span for the batch, and one per event joining the trace of
	// whoever appended it, ended when the event's writes are durable.
	bctx, span := p.tracer.Start(ctx, "health.project.batch", trace.WithAttributes(attribute.Int("events", len(evs))))
	var spans []trace.Span
	for i := range evs {
		ev := &evs[i]
		if ev.header == nil {
			continue
		}
		sc := trace.SpanContextFromContext(telemetry.Extract(context.Background(), ev.header))
		if !sc.IsValid() {
			continue
		}
		_, s := p.tracer.Start(trace.ContextWithRemoteSpanContext(ctx, sc), "health.project",
			trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithLinks(trace.LinkFromContext(bctx)),
			trace.WithAttributes(attribute.String("subject", ev.subject), attribute.Int64("seq", int64(ev.seq))))
		spans = append(spans, s)
	}
	err := p.applyRetrying(bctx, evs, msgs)
	for _, s := range spans {
		s.End()
	}
	span.End()
	if err != nil {
		return err
	}
	counts := map[string]int64{}
	for i := range evs {
		counts[evs[i].agg]++
	}
	for agg, n := range counts {
		p.applied.Add(ctx, n, metric.WithAttributes(attribute.String("aggregate", agg)))
	}
	for _, m := range msgs {
		if err := m.Ack(); err != nil {
			// The event comes back after ackWait and is skipped by its sequence.
			p.log.Warn("ack failed", "subject", m.Subject(), "err", err)
		}
	}
	return nil
}

func (p *Projector) applyRetrying(ctx context.Context, evs []event, msgs []jetstream.Msg) error {
	delay := 100 * time.Millisecond
	for {
		err := p.apply(ctx, evs)
		if err == nil || errors.Is(err, errCrashed) {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.log.Warn("applying events failed; retrying", "first_seq", evs[0].seq, "events", len(evs), "in", delay.String(), "err", err)
		for _, m := range msgs {
			_ = m.InProgress()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 5*time.Second)
	}
}

// source pulls messages from an iterator and prepares them, while the
// caller applies the previous batch, and hands them out in batches.
type source struct {
	it   jetstream.MessagesContext
	in   chan delivery
	done chan struct{}
	wg   sync.WaitGroup
	pin  string
	nc   *nats.Conn
	log  *slog.Logger
	held *delivery // the start of the next batch: a message or the error
	// seen is the pin of the last message pulled, kept by the puller.
	seen atomic.Pointer[string]
	// exited: the puller has returned (see [source.stop]).
	exited bool
}

// delivery is one message and its event, or the error that ended the
// iterator.
type delivery struct {
	msg jetstream.Msg
	ev  event
	ok  bool   // the message has JetStream metadata; ev is prepared
	end uint64 // messages the stream holds after this one
	err error
}

// batchIn is one batch from a source.
type batchIn struct {
	evs  []event         // in stream order
	msgs []jetstream.Msg // the messages of evs
	bad  []jetstream.Msg // messages without JetStream metadata
	pin  string          // the pin they were delivered under
	last bool            // the batch ends at the message wanted last
	n    int             // messages
}

// newSource starts pulling from it, preparing up to ahead messages with p
// while the caller applies the previous batch. A batch holds the messages
// of one pin: the pin the caller holds, or the first message alone.
func newSource(p *Projector, it jetstream.MessagesContext, pin string, ahead int) *source {
	s := &source{it: it, nc: p.conn.NC, log: p.log, in: make(chan delivery, ahead), done: make(chan struct{}), pin: pin}
	s.wg.Go(func() {
		for {
			m, err := it.Next()
			d := delivery{msg: m, err: err}
			if err == nil {
				seen := m.Headers().Get(pinHeader)
				s.seen.Store(&seen)
				if p.deaf != nil && p.deaf() {
					continue
				}
				if md, merr := m.Metadata(); merr == nil {
					d.ev, d.ok, d.end = p.prepare(md.Sequence.Stream, m.Subject(), m.Data(), m.Headers()), true, md.NumPending
				}
			}
			select {
			case s.in <- d:
			case <-s.done:
				return
			}
			if err != nil {
				return
			}
		}
	})
	return s
}

// next returns the next batch: at least one message and at most limit.
// With until > 0 it ends at the message stored at until, or the last one
// the stream holds, and waits for limit messages before that; otherwise
// it takes what has arrived.
func (s *source) next(ctx context.Context, limit int, until uint64) (*batchIn, error) {
	var first delivery
	if s.held != nil {
		first, s.held = *s.held, nil
	} else {
		select {
		case first = <-s.in:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if first.err != nil {
		s.held = &first // the iterator has ended: it stays ended
		return nil, first.err
	}
	size := limit
	if until == 0 {
		size = min(limit, 1+len(s.in))
	}
	b := &batchIn{evs: make([]event, 0, size), msgs: make([]jetstream.Msg, 0, size), pin: first.msg.Headers().Get(pinHeader)}
	b.add(first, until)
	if b.pin != s.pin || b.last {
		return b, nil
	}
	for b.n < limit {
		var d delivery
		if until > 0 {
			select {
			case d = <-s.in:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		} else {
			select {
			case d = <-s.in:
			default:
				return b, nil
			}
		}
		if d.err != nil || d.msg.Headers().Get(pinHeader) != s.pin {
			s.held = &d
			return b, nil
		}
		if b.add(d, until); b.last {
			break
		}
	}
	return b, nil
}

// follows reports whether the batch's messages are the deliveries next,
// next+1, ... of the consumer, none missing, and if not the delivery
// sequence found instead of the one wanted.
func (b *batchIn) follows(next uint64) (uint64, bool) {
	want := next
	for _, m := range b.msgs {
		md, err := m.Metadata()
		if err != nil {
			continue
		}
		// A message without metadata (b.bad) counts as one delivery:
		// the others must still fit into the batch's size.
		if d := md.Sequence.Consumer; d < want || d >= next+uint64(b.n) {
			return d, false
		}
		want = md.Sequence.Consumer + 1
	}
	return 0, true
}

// add appends d and notes whether it is the last message wanted: stored
// at until or later, or the last the stream holds.
func (b *batchIn) add(d delivery, until uint64) {
	b.n++
	if !d.ok {
		b.bad = append(b.bad, d.msg)
		return
	}
	b.evs, b.msgs = append(b.evs, d.ev), append(b.msgs, d.msg)
	b.last = until > 0 && (d.ev.seq >= until || d.end == 0)
}

// stop ends the pulling, dropping the messages in flight, and returns the
// pin of the last message pulled ("" if none was).
//
// It waits at most stopWait for the puller to return: the iterator's Next
// returns once the client has unsubscribed, which nothing on this side
// bounds, and a projector waiting for it without end would neither
// project nor give its pin up. A puller that did not return is left
// behind; it returns whenever Next does, and drops what it got.
func (s *source) stop() string {
	s.it.Stop()
	close(s.done)
	exited := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(exited)
	}()
	t := time.NewTimer(stopWait)
	defer t.Stop()
	select {
	case <-exited:
		s.exited = true
	case <-t.C:
		s.log.Warn("pulling did not stop in time; going on without waiting for it", "waited", stopWait.String())
	}
	if seen := s.seen.Load(); seen != nil {
		return *seen
	}
	return ""
}

// forgotten returns once the server has dropped the pull requests of the
// stopped source s (their inbox has no subscriber any more), so that a
// reset made after it delivers nothing to them.
func (s *source) forgotten() {
	// Closed takes the lock the iterator's Next holds while it waits: only
	// once the puller returned can it be asked.
	if it, ok := s.it.(interface{ Closed() <-chan struct{} }); ok && s.exited {
		// The channel Closed returns for a Messages iterator is closed
		// only if the iterator has unsubscribed by the time Closed is
		// called (its unsubscribe, after Stop, is asynchronous): ask
		// again until it has.
		deadline := time.NewTimer(stopWait)
		defer deadline.Stop()
		poll := time.NewTicker(stopPoll)
		defer poll.Stop()
	wait:
		for {
			select {
			case <-it.Closed():
				break wait
			case <-deadline.C:
				break wait
			case <-poll.C:
			}
		}
	}
	// The unsubscribe is sent before the PING, so the server has
	// processed it when the PONG comes back.
	_ = s.nc.FlushTimeout(stopWait)
}

// followLag exports, until ctx ends, the backlog gauges of the projection's
// consumer and proxyfleet_health_projection_lag_events: the events of
// FLEET_EVENTS not yet in the views, the log's last sequence minus the
// consumer's acknowledgement floor (the projection acknowledges an event
// once its writes are durable). All replicas report the same figures.
func (p *Projector) followLag(ctx context.Context) {
	var lag atomic.Int64
	lag.Store(-1) // unknown until the first refresh
	gauge, err := p.meter.Int64ObservableGauge("proxyfleet_health_projection_lag_events",
		metric.WithDescription("Events of FLEET_EVENTS not yet folded into the views."))
	if err == nil {
		var reg metric.Registration
		reg, err = p.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
			if n := lag.Load(); n >= 0 {
				o.ObserveInt64(gauge, n)
			}
			return nil
		}, gauge)
		if err == nil {
			defer func() { _ = reg.Unregister() }()
		}
	}
	if err != nil {
		p.log.Warn("projection lag gauge", "err", err)
	}
	err = bus.FollowConsumer(ctx, p.conn, p.meter, bus.EventsStream, ConsumerName, p.statsEvery,
		func(ctx context.Context, info *jetstream.ConsumerInfo) {
			st, err := p.conn.JS.Stream(ctx, bus.EventsStream)
			if err != nil {
				return
			}
			last, floor := st.CachedInfo().State.LastSeq, info.AckFloor.Stream
			lag.Store(int64(max(last, floor) - floor))
		})
	if err != nil {
		p.log.Warn("projection consumer gauges", "err", err)
	}
}
