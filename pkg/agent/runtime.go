package agent

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/nats-io/nkeys"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/telemetry"
)

// Config tunes a [Runtime]. Zero values take the defaults noted.
type Config struct {
	// Info is announced in heartbeats and answered to info requests.
	Info Info
	// CommandTimeout bounds one command, including waiting for an address
	// (default 10m).
	CommandTimeout time.Duration
	// WatchInterval is how often an instance without an address is polled
	// (default 2s).
	WatchInterval time.Duration
	// Concurrency bounds commands handled at once (default 8).
	Concurrency int
	// HeartbeatInterval is how often the agent refreshes its fleet-agents
	// entry (default 5s; the entry expires after [bus.AgentTTL]).
	HeartbeatInterval time.Duration
	// CheckTimeout bounds one check request (default 15s).
	CheckTimeout time.Duration
	// RecheckInterval is how often the agent lists its instances to find
	// proxies whose instance terminated or disappeared behind its back
	// (default [DefaultRecheckInterval]; negative turns the recheck off).
	// It bounds how long a dead instance goes unnoticed by its agent: the
	// failed event follows within one interval plus one List call.
	RecheckInterval time.Duration
	// EgressEndpoints are address:port pairs every proxy of this agent may
	// reach whatever the egress policy: the health echo endpoint the probes
	// fetch (see package egress).
	EgressEndpoints []netip.AddrPort
	// Key is the agent's curve (xkey) key: create commands carry the
	// pool's secrets sealed to its public half, announced in heartbeats.
	// Nil loads it from KeyDir.
	Key nkeys.KeyPair
	// Meter makes the runtime's instruments (see docs/observability.md,
	// "Agents"). Nil takes the global meter provider's, which
	// telemetry.Setup installs.
	Meter metric.Meter
	// ConsumerMetricsInterval is how often the backlog of the command
	// consumer is read for its gauges (default
	// [bus.ConsumerMetricsInterval]).
	ConsumerMetricsInterval time.Duration
	// KeyDir holds the key's seed file "<entry>.<target>.xk" (0600,
	// created on first start), so a restarted agent opens the commands
	// queued for it. Empty with a nil Key makes a key that lives as long
	// as the process (tests).
	KeyDir string
}

// DefaultRecheckInterval is the default [Config.RecheckInterval].
const DefaultRecheckInterval = 10 * time.Second

func (c *Config) defaults() {
	c.Info.Version = cmp.Or(c.Info.Version, buildinfo.Version)
	if c.CommandTimeout <= 0 {
		c.CommandTimeout = 10 * time.Minute
	}
	if c.WatchInterval <= 0 {
		c.WatchInterval = 2 * time.Second
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 8
	}
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = 5 * time.Second
	}
	if c.CheckTimeout <= 0 {
		c.CheckTimeout = 15 * time.Second
	}
	if c.RecheckInterval == 0 {
		c.RecheckInterval = DefaultRecheckInterval
	}
}

// Heartbeat is the value an agent keeps in the fleet-agents bucket under
// "<entry>.<target>".
type Heartbeat struct {
	Info
	Instances int       `json:"instances"`
	StartedAt time.Time `json:"startedAt"`
	At        time.Time `json:"at"`
	// XKey is the agent's curve public key: the planner seals the pool's
	// secrets in create commands to it.
	XKey string `json:"xkey,omitempty"`
}

// HeartbeatKey is the fleet-agents key of one agent: "<entry>.<target>".
func HeartbeatKey(entry, target string) string { return entry + "." + target }

// Runtime runs one agent: one entry, one target, one driver.
type Runtime struct {
	conn   *bus.Conn
	drv    measured // the backend's driver, its calls measured
	prep   Preparer // the driver's Preparer capability, or nil
	source string
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer
	store  *bus.EventStore
	sem    chan struct{}
	queue  *keyedQueue
	start  time.Time
	m      metrics
	key    nkeys.KeyPair
}

// metrics are the runtime's OTel instruments (no-ops without a meter
// provider).
type metrics struct {
	meter    metric.Meter
	commands metric.Int64Counter
	duration metric.Float64Histogram
	calls    metric.Float64Histogram
}

// DurationBuckets are the bucket boundaries, in seconds, of the agent's
// duration histograms: from 5 ms (a local process) to 20 min (a cloud
// instance installing its proxy), the command timeout's range.
var DurationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200}

func newMetrics(m metric.Meter) metrics {
	if m == nil {
		m = otel.Meter("proxyfleet/agent")
	}
	c, _ := m.Int64Counter("proxyfleet_agent_commands_total",
		metric.WithDescription("Commands handled by the agent, by verb and outcome (done, failed, retried, dropped, interrupted)."))
	d, _ := m.Float64Histogram("proxyfleet_agent_command_duration_seconds",
		metric.WithDescription("Time from taking a command to its outcome."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(DurationBuckets...))
	calls, _ := m.Float64Histogram("proxyfleet_agent_driver_call_duration_seconds",
		metric.WithDescription("One call of the backend driver, by op (create, delete, observe, inventory, check, prepare) and outcome (ok, error)."),
		metric.WithUnit("s"), metric.WithExplicitBucketBoundaries(DurationBuckets...))
	return metrics{meter: m, commands: c, duration: d, calls: calls}
}

func (r *Runtime) record(ctx context.Context, verb, outcome string, started time.Time) {
	attrs := metric.WithAttributes(attribute.String("verb", verb), attribute.String("outcome", outcome),
		attribute.String("entry", r.cfg.Info.Entry), attribute.String("target", r.cfg.Info.Target))
	r.m.commands.Add(ctx, 1, attrs)
	r.m.duration.Record(ctx, time.Since(started).Seconds(), attrs)
}

// New returns a runtime for drv. tracer may be nil (no tracing).
func New(conn *bus.Conn, drv Driver, cfg Config, log *slog.Logger, tracer trace.Tracer) (*Runtime, error) {
	cfg.defaults()
	var v events.ValidationError
	v.AddField(events.CheckIdentifier("entry", cfg.Info.Entry))
	if cfg.Info.Entry == events.ProviderExternal {
		v.Add("entry", "is reserved for external pools, whose proxies no agent serves; name the entry otherwise", cfg.Info.Entry)
	}
	v.AddField(events.CheckIdentifier("target", cfg.Info.Target))
	events.CheckLabels(&v, "labels", cfg.Info.Labels)
	if err := v.Err(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if tracer == nil {
		tracer = noop.NewTracerProvider().Tracer("")
	}
	log = log.With("entry", cfg.Info.Entry, "target", cfg.Info.Target)
	key, err := agentKey(cfg)
	if err != nil {
		return nil, err
	}
	m := newMetrics(cfg.Meter)
	prep, _ := drv.(Preparer)
	source := events.AgentSource(cfg.Info.Entry, cfg.Info.Target)
	return &Runtime{
		key:    key,
		conn:   conn,
		drv:    measured{next: drv, calls: m.calls, entry: cfg.Info.Entry, target: cfg.Info.Target},
		prep:   prep,
		source: source,
		cfg:    cfg,
		log:    log,
		tracer: tracer,
		store:  bus.NewEventStore(conn, source, log),
		sem:    make(chan struct{}, cfg.Concurrency),
		queue:  newKeyedQueue(),
		start:  time.Now().UTC(),
		m:      m,
	}, nil
}

// Run serves until ctx ends: it consumes commands, heartbeats, answers
// requests, and first resumes watching instances that had not reached
// running when the agent last stopped.
func (r *Runtime) Run(ctx context.Context) error {
	info := r.cfg.Info
	cons, err := bus.EnsureAgentConsumer(ctx, r.conn, info.Entry, info.Target)
	if err != nil {
		return fmt.Errorf("command consumer: %w", err)
	}
	svc, err := r.startService()
	if err != nil {
		return fmt.Errorf("fleet-agent service: %w", err)
	}
	defer func() { _ = svc.Stop() }()

	kv, err := r.conn.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		return err
	}
	r.heartbeat(ctx, kv)
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		t := time.NewTicker(r.cfg.HeartbeatInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				r.heartbeat(ctx, kv)
			}
		}
	}()

	r.resume(ctx)
	recheckDone := make(chan struct{})
	go func() { defer close(recheckDone); r.recheckLoop(ctx) }()
	statsDone := make(chan struct{})
	go func() {
		defer close(statsDone)
		err := bus.FollowConsumer(ctx, r.conn, r.m.meter, bus.CommandsStream, bus.AgentConsumerName(info.Entry, info.Target), r.cfg.ConsumerMetricsInterval, nil)
		if err != nil {
			r.log.Warn("consumer gauges", "err", err)
		}
	}()

	cc, err := cons.Consume(func(msg jetstream.Msg) { r.dispatch(ctx, msg) },
		jetstream.PullMaxMessages(r.cfg.Concurrency*2))
	if err != nil {
		return fmt.Errorf("consume commands: %w", err)
	}
	r.log.Info("agent started", "type", info.Type, "consumer", bus.AgentConsumerName(info.Entry, info.Target))
	<-ctx.Done()
	cc.Stop()
	<-recheckDone
	<-statsDone
	r.queue.Wait()
	<-hbDone
	dctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = kv.Delete(dctx, HeartbeatKey(info.Entry, info.Target))
	r.log.Info("agent stopped")
	return nil
}

func (r *Runtime) heartbeat(ctx context.Context, kv jetstream.KeyValue) {
	lctx, cancel := context.WithTimeout(ctx, r.cfg.CheckTimeout)
	defer cancel()
	hb := Heartbeat{Info: r.cfg.Info, StartedAt: r.start, At: time.Now().UTC(), XKey: seal.Public(r.key)}
	if list, err := r.drv.List(lctx); err == nil {
		hb.Instances = len(list)
	} else {
		r.log.Warn("heartbeat: list instances", "err", err)
		hb.Instances = -1
	}
	b, _ := json.Marshal(hb)
	if _, err := kv.Put(ctx, HeartbeatKey(r.cfg.Info.Entry, r.cfg.Info.Target), b); err != nil && ctx.Err() == nil {
		r.log.Warn("heartbeat", "err", err)
	}
}

func (r *Runtime) startService() (micro.Service, error) {
	info := r.cfg.Info
	svc, err := micro.AddService(r.conn.NC, micro.Config{
		Name:        "fleet-agent",
		Version:     buildinfo.Version,
		Description: "proxyfleet agent for " + info.Entry + "/" + info.Target,
		Metadata:    map[string]string{"entry": info.Entry, "target": info.Target, "type": info.Type},
	})
	if err != nil {
		return nil, err
	}
	g := svc.AddGroup(events.AgentGroup(info.Entry, info.Target))
	add := func(name string, fn func(ctx context.Context, body []byte) (any, error)) error {
		return g.AddEndpoint(name, micro.HandlerFunc(func(req micro.Request) {
			ctx, cancel := context.WithTimeout(context.Background(), r.cfg.CheckTimeout)
			defer cancel()
			out, err := fn(ctx, req.Data())
			var bad *badRequest
			switch {
			case errors.As(err, &bad):
				_ = req.Error("400", bad.Error(), nil)
				return
			case err != nil:
				r.log.Warn("request failed", "endpoint", name, "err", err)
				_ = req.Error("500", err.Error(), nil)
				return
			}
			_ = req.RespondJSON(out)
		}))
	}
	if err := add(events.AgentInfo, func(context.Context, []byte) (any, error) { return info, nil }); err != nil {
		return nil, err
	}
	if err := add(events.AgentInventory, r.inventory); err != nil {
		return nil, err
	}
	if err := add(events.AgentCheck, func(ctx context.Context, _ []byte) (any, error) {
		v := r.drv.Check(ctx)
		if v == nil {
			v = []Verdict{}
		}
		return v, nil
	}); err != nil {
		return nil, err
	}
	return svc, nil
}

// resume finds marked instances whose proxy's last event is provisioning and
// watches them until they report an address, as an interrupted create would
// have.
func (r *Runtime) resume(ctx context.Context) {
	lctx, cancel := context.WithTimeout(ctx, r.cfg.CheckTimeout)
	list, err := r.drv.List(lctx)
	cancel()
	if err != nil {
		r.log.Warn("resume: list instances", "err", err)
		return
	}
	for _, inst := range list {
		if inst.Marker.ProxyID == "" || !events.IsIdentifier(inst.Marker.ProxyID) {
			continue
		}
		last, err := r.lastEvent(ctx, inst.Marker.ProxyID)
		if err != nil || last == nil || last.Kind != events.ProxyProvisioning {
			continue
		}
		var prov events.ProxyProvisioningData
		if err := last.DecodeData(&prov); err != nil || prov.Entry != r.cfg.Info.Entry || prov.Target != r.cfg.Info.Target {
			continue
		}
		inst := inst
		r.log.Info("resuming watch", "proxy", inst.Marker.ProxyID, "instance", inst.Name)
		r.queue.Submit(inst.Marker.ProxyID, func() {
			r.sem <- struct{}{}
			defer func() { <-r.sem }()
			wctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
			defer cancel()
			ref := Ref{ProxyID: inst.Marker.ProxyID, Name: inst.Name, ProviderID: cmp.Or(prov.ProviderID, inst.ProviderID)}
			// List's cheap state is not the word on a proxy's start: watch
			// it through Get, which also lets a driver record what it finds.
			got, err := r.waitRunning(wctx, ref, Instance{Name: inst.Name, ProviderID: inst.ProviderID, Marker: inst.Marker})
			if err != nil {
				r.log.Warn("resume: instance did not reach running; its command will be retried", "proxy", ref.ProxyID, "err", err)
				return
			}
			if err := r.appendRunning(wctx, ref.ProxyID, prov.Attempt, got); err != nil {
				r.log.Warn("resume: publish running", "proxy", ref.ProxyID, "err", err)
			}
		})
	}
}

func (r *Runtime) dispatch(ctx context.Context, msg jetstream.Msg) {
	verb := msg.Subject()[strings.LastIndexByte(msg.Subject(), '.')+1:]
	env, err := events.DecodeEnvelope(msg.Data())
	if err != nil {
		r.log.Error("dropping undecodable command", "subject", msg.Subject(), "err", err)
		_ = msg.Term()
		return
	}
	// handle runs the command and returns its outcome.
	var proxyID string
	var handle func() string
	switch verb {
	case events.VerbCreate:
		var cmd events.CreateCommand
		if err := env.DecodeData(&cmd); err != nil {
			r.log.Error("dropping invalid create command", "err", err)
			_ = msg.Term()
			return
		}
		proxyID, handle = cmd.ProxyID, func() string { return r.handleCreate(ctx, msg, cmd) }
	case events.VerbDelete:
		var cmd events.DeleteCommand
		if err := env.DecodeData(&cmd); err != nil {
			r.log.Error("dropping invalid delete command", "err", err)
			_ = msg.Term()
			return
		}
		proxyID, handle = cmd.ProxyID, func() string { return r.handleDelete(ctx, msg, cmd) }
	default:
		r.log.Error("dropping command with unknown verb", "subject", msg.Subject())
		_ = msg.Term()
		return
	}
	stop := keepAlive(ctx, msg)
	r.queue.Submit(proxyID, func() {
		defer stop()
		r.withSlot(func() {
			started := time.Now()
			r.record(ctx, verb, handle(), started)
		})
	})
}

func (r *Runtime) withSlot(fn func()) {
	r.sem <- struct{}{}
	defer func() { <-r.sem }()
	fn()
}

// keepAlive tells JetStream the command is still being worked on, so it is
// not redelivered while it waits in its proxy's queue or for a concurrency
// slot, nor while a long create runs. dispatch starts it the moment the
// command is taken; the handler's end stops it.
func keepAlive(ctx context.Context, msg jetstream.Msg) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(bus.AgentAckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				_ = msg.InProgress()
			}
		}
	}()
	return func() { cancel(); <-done }
}

func (r *Runtime) handleCreate(ctx context.Context, msg jetstream.Msg, cmd events.CreateCommand) string {
	ctx, log, done := r.begin(ctx, msg, events.VerbCreate, cmd.ProxyID, cmd.Pool, cmd.Attempt)
	defer done()

	last, err := r.lastEvent(ctx, cmd.ProxyID)
	if err != nil {
		return r.retry(ctx, msg, log, fmt.Errorf("read proxy state: %w", err))
	}
	var providerID string
	if last != nil {
		switch last.Kind {
		case events.ProxyRetiring, events.ProxyDeleted, events.ProxyAbandoned:
			log.InfoContext(ctx, "dropping create: proxy is "+last.Kind)
			r.ack(ctx, msg, log)
			return "dropped"
		case events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
			log.InfoContext(ctx, "create already done: proxy is "+last.Kind)
			r.ack(ctx, msg, log)
			return "dropped"
		case events.ProxyFailed:
			var f events.ProxyFailedData
			if last.DecodeData(&f) == nil && f.Attempt >= cmd.Attempt {
				log.InfoContext(ctx, "dropping create: this attempt already failed")
				r.ack(ctx, msg, log)
				return "dropped"
			}
		case events.ProxyProvisioning:
			var p events.ProxyProvisioningData
			if last.DecodeData(&p) == nil {
				providerID = p.ProviderID
			}
		}
	}
	if err := r.unseal(&cmd); err != nil {
		return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, err)
	}
	spec, err := SpecOf(cmd, providerID, r.cfg.EgressEndpoints)
	if err != nil {
		return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, err)
	}
	cctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	if r.prep != nil {
		id, err := r.measure(cctx, "prepare", func() (string, error) { return r.prep.Prepare(cctx, spec) })
		if err != nil {
			return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, fmt.Errorf("prepare: %w", err))
		}
		spec.ProviderID = id
	}
	if last == nil || last.Kind != events.ProxyProvisioning || providerID != spec.ProviderID {
		prov := events.ProxyProvisioningData{Entry: cmd.Entry, Target: cmd.Target, Instance: cmd.Instance, ProviderID: spec.ProviderID, Attempt: cmd.Attempt}
		id := events.ProxyEventID(cmd.ProxyID, events.ProxyProvisioning, uint64(cmd.Attempt))
		if spec.ProviderID != providerID && providerID != "" {
			id += "." + spec.ProviderID
		}
		if err := r.publish(ctx, cmd.ProxyID, events.ProxyProvisioning, id, prov); err != nil {
			return r.retry(ctx, msg, log, fmt.Errorf("publish provisioning: %w", err))
		}
	}
	inst, err := r.drv.Create(cctx, spec)
	if err != nil {
		return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, fmt.Errorf("create %s: %w", cmd.Instance, err))
	}
	ref := Ref{ProxyID: cmd.ProxyID, Name: cmd.Instance, ProviderID: cmp.Or(inst.ProviderID, spec.ProviderID)}
	inst, err = r.waitRunning(cctx, ref, inst)
	if err != nil {
		return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, err)
	}
	if err := r.appendRunning(ctx, cmd.ProxyID, cmd.Attempt, inst); err != nil {
		return r.retry(ctx, msg, log, fmt.Errorf("publish running: %w", err))
	}
	log.InfoContext(ctx, "proxy running", "instance", inst.Name, "address", inst.Address)
	r.ack(ctx, msg, log)
	return "done"
}

// begin starts the handling of one command: the trace continues the
// command's, a span covers the work and the log carries the proxy; log
// with the returned ctx so that each line carries the span's ids. done
// ends the span. (InProgress is kept up by dispatch, from the moment the
// command was taken.)
func (r *Runtime) begin(ctx context.Context, msg jetstream.Msg, verb, proxyID, pool string, attempt int) (context.Context, *slog.Logger, func()) {
	ctx = telemetry.Extract(ctx, msg.Headers())
	attrs := append(telemetry.MessagingAttrs(telemetry.OpProcess, msg.Subject(), ""),
		attribute.String("proxy", proxyID), attribute.String("pool", pool),
		attribute.String("entry", r.cfg.Info.Entry), attribute.String("target", r.cfg.Info.Target), attribute.Int("attempt", attempt),
		telemetry.AttrConsumerGroup.String(bus.AgentConsumerName(r.cfg.Info.Entry, r.cfg.Info.Target)))
	if id := msg.Headers().Get(jetstream.MsgIDHeader); id != "" {
		attrs = append(attrs, telemetry.AttrMessageID.String(id))
	}
	ctx, span := r.tracer.Start(ctx, "agent."+verb, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	log := r.log.With("proxy", proxyID, "pool", pool, "attempt", attempt)
	return ctx, log, func() { span.End() }
}

// publish appends one observation of proxyID to FLEET_EVENTS under a
// producer span of its own, which the event carries as its trace context.
func (r *Runtime) publish(ctx context.Context, proxyID, kind, msgID string, data any) error {
	return r.publishExpecting(ctx, proxyID, kind, msgID, data, nil)
}

// publishExpecting appends an observation that holds only while the
// proxy's last event is still the one expect names: a conflict means the
// proxy changed since it was judged, and nothing is appended.
func (r *Runtime) publishExpecting(ctx context.Context, proxyID, kind, msgID string, data any, expect *bus.Expect) error {
	ctx, span := r.tracer.Start(ctx, "agent.publish", trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(telemetry.MessagingAttrs(telemetry.OpSend, events.SubjectOf(r.source, events.AggregateProxy, proxyID, kind), "")...),
		trace.WithAttributes(attribute.String("proxy", proxyID), attribute.String("event", kind), telemetry.AttrMessageID.String(msgID)))
	defer span.End()
	_, err := r.store.Append(ctx, events.AggregateProxy, proxyID, kind, msgID, data, expect)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "append "+kind+" failed")
	}
	return err
}

// spanFailed marks the span of ctx as failed with err.
func spanFailed(ctx context.Context, err error, what string) {
	span := trace.SpanFromContext(ctx)
	span.RecordError(err)
	span.SetStatus(codes.Error, what)
}

func (r *Runtime) appendRunning(ctx context.Context, proxyID string, attempt int, inst Instance) error {
	run := events.ProxyRunningData{ProviderID: inst.ProviderID, Address: inst.Address, Attempt: attempt}
	return r.publish(ctx, proxyID, events.ProxyRunning, events.ProxyEventID(proxyID, events.ProxyRunning, uint64(attempt)), run)
}

// waitRunning polls the driver until the instance is running with an
// address, it terminates, or ctx ends.
func (r *Runtime) waitRunning(ctx context.Context, ref Ref, inst Instance) (Instance, error) {
	t := time.NewTicker(r.cfg.WatchInterval)
	defer t.Stop()
	for {
		switch {
		case inst.State == StateRunning && inst.Address != "":
			return inst, nil
		case inst.State == StateTerminated:
			return inst, Wrapf(ErrPermanent, "instance %s terminated: %s", ref.Name, inst.Detail)
		}
		select {
		case <-ctx.Done():
			return inst, Wrapf(ErrTransient, "instance %s has no address yet: %w", ref.Name, ctx.Err())
		case <-t.C:
		}
		got, err := r.drv.Get(ctx, ref)
		if errors.Is(err, ErrNotFound) {
			return inst, Wrapf(ErrTransient, "instance %s vanished while starting", ref.Name)
		}
		if err != nil {
			if Classify(err) == ClassPermanent {
				return inst, err
			}
			r.log.DebugContext(ctx, "watch: get failed, will retry", "proxy", ref.ProxyID, "err", err)
			continue
		}
		inst = got
	}
}

func (r *Runtime) handleDelete(ctx context.Context, msg jetstream.Msg, cmd events.DeleteCommand) string {
	ctx, log, done := r.begin(ctx, msg, events.VerbDelete, cmd.ProxyID, cmd.Pool, cmd.Attempt)
	defer done()

	last, err := r.lastEvent(ctx, cmd.ProxyID)
	if err != nil {
		return r.retry(ctx, msg, log, fmt.Errorf("read proxy state: %w", err))
	}
	if last != nil && events.IsTerminal(last.Kind) {
		log.InfoContext(ctx, "delete already done: proxy is "+last.Kind)
		r.ack(ctx, msg, log)
		return "dropped"
	}
	cctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	err = r.drv.Delete(cctx, Ref{ProxyID: cmd.ProxyID, Name: cmd.Instance, ProviderID: cmd.ProviderID})
	if err != nil && Classify(err) != ClassNotFound {
		return r.fail(ctx, msg, log, cmd.ProxyID, cmd.Attempt, fmt.Errorf("delete %s: %w", cmd.Instance, err))
	}
	if err := r.publish(ctx, cmd.ProxyID, events.ProxyDeleted,
		events.ProxyEventID(cmd.ProxyID, events.ProxyDeleted, uint64(cmd.Attempt)), events.ProxyDeletedData{Attempt: cmd.Attempt}); err != nil {
		return r.retry(ctx, msg, log, fmt.Errorf("publish deleted: %w", err))
	}
	log.InfoContext(ctx, "proxy deleted", "instance", cmd.Instance)
	r.ack(ctx, msg, log)
	return "done"
}

// fail handles a driver error by class: transient errors are retried with
// backoff (until the last delivery, which records a failure); quota and
// permanent errors record a failed event and acknowledge the command.
func (r *Runtime) fail(ctx context.Context, msg jetstream.Msg, log *slog.Logger, proxyID string, attempt int, err error) string {
	class := Classify(err)
	if ctx.Err() != nil {
		// Shutting down: leave the command for redelivery.
		log.InfoContext(ctx, "command interrupted by shutdown", "err", err)
		return "interrupted"
	}
	evClass := events.ClassPermanent
	switch class {
	case ClassQuota:
		evClass = events.ClassQuota
	case ClassTransient, ClassNotFound:
		md, merr := msg.Metadata()
		if merr != nil || md.NumDelivered < bus.AgentMaxDeliver {
			return r.retry(ctx, msg, log, err)
		}
		evClass = events.ClassDeadLetter
	}
	spanFailed(ctx, err, "command failed: "+evClass)
	log.WarnContext(ctx, "command failed", "class", evClass, "err", err)
	data := events.ProxyFailedData{Class: evClass, Reason: err.Error(), Attempt: attempt}
	if aerr := r.publish(ctx, proxyID, events.ProxyFailed,
		events.ProxyEventID(proxyID, events.ProxyFailed, uint64(attempt)), data); aerr != nil {
		return r.retry(ctx, msg, log, fmt.Errorf("publish failed: %w", aerr))
	}
	r.ack(ctx, msg, log)
	return "failed"
}

// retry asks JetStream to redeliver msg after a backoff that grows with
// each delivery.
func (r *Runtime) retry(ctx context.Context, msg jetstream.Msg, log *slog.Logger, err error) string {
	if ctx.Err() != nil {
		return "interrupted"
	}
	delay := time.Second
	if md, merr := msg.Metadata(); merr == nil {
		delay = backoff(md.NumDelivered)
	}
	spanFailed(ctx, err, "command will be retried")
	log.WarnContext(ctx, "command will be retried", "in", delay.String(), "err", err)
	_ = msg.NakWithDelay(delay)
	return "retried"
}

func backoff(delivered uint64) time.Duration {
	d := time.Second
	for i := uint64(1); i < delivered && d < time.Minute; i++ {
		d *= 2
	}
	if d > time.Minute {
		d = time.Minute
	}
	return d
}

// ack acknowledges a command that is done, dropped or failed for good.
// The ack is sent, not awaited: what the command did is in the log
// already, so an ack that is lost only brings the command back, and the
// agent then finds it done (its observation is the proxy's last event)
// and acknowledges it again. Awaiting it would hold the command's slot
// for one more round trip to the server.
func (r *Runtime) ack(ctx context.Context, msg jetstream.Msg, log *slog.Logger) {
	if err := msg.Ack(); err != nil {
		log.WarnContext(ctx, "ack failed; the command may be redelivered and will be found done", "err", err)
	}
}

// badRequest is a request an agent endpoint refuses with 400.
type badRequest struct{ reason string }

func (e *badRequest) Error() string { return e.reason }

// Inventory is one page of an agent's inventory reply: its marked
// instances ordered by name, and the Next cursor (see package [page]).
type Inventory struct {
	Instances []Instance `json:"instances"`
	Next      string     `json:"next"`
}

// inventory answers one page of the target's marked instances. The body
// is empty (the first page) or a [page.Request]; each reply fits in one
// message however many instances the target holds.
func (r *Runtime) inventory(ctx context.Context, body []byte) (any, error) {
	var req page.Request
	if len(bytes.TrimSpace(body)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			return nil, &badRequest{"inventory request: want {\"limit\":N,\"after\":\"<next>\"} or nothing: " + err.Error()}
		}
	}
	limit := cmp.Or(req.Limit, page.DefaultLimit)
	if limit < 1 || limit > page.MaxLimit {
		return nil, &badRequest{fmt.Sprintf("inventory request: limit must be between 1 and %d, got %d", page.MaxLimit, req.Limit)}
	}
	list, err := r.drv.List(ctx)
	if err != nil {
		return nil, err
	}
	name := func(i Instance) string { return i.Name }
	items := page.FirstAfter(slices.Values(list), name, req.After, limit+1)
	return page.Encode("instances", items, name, limit, page.Budget(r.conn.NC.MaxPayload()))
}

// lastEvent returns the last event of proxy id this agent acts on: the
// planner's and health's, and its own. Another agent's observation (on
// that agent's subject, the only one it may publish on) says nothing about
// this agent's instances, so a forged deleted or running cannot make this
// agent drop a command.
func (r *Runtime) lastEvent(ctx context.Context, id string) (*bus.Event, error) {
	return r.store.LastSeenBy(ctx, id, events.Observer{Entry: r.cfg.Info.Entry, Target: r.cfg.Info.Target})
}
