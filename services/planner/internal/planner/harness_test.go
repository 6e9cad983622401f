package planner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// waitTimeout bounds every wait for a condition.
const waitTimeout = 30 * time.Second

// harness is one embedded NATS server with the topology, the fake agents'
// heartbeats and the readers a test asserts with.
type harness struct {
	t      *testing.T
	c      *bus.Conn
	store  *bus.EventStore
	agents jetstream.KeyValue
	secret jetstream.KeyValue

	// health is fleet-health, where a fake health replica keeps its key
	// alive unless the test took health down (healthDown).
	health   jetstream.KeyValue
	noHealth atomic.Bool

	mu  sync.Mutex
	hbs map[string]agent.Info
	// keys are the fake agents' curve keys, by heartbeat key: their
	// heartbeats announce them, and commands sealed to them are opened
	// with them.
	keys map[string]nkeys.KeyPair
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	c := bustest.Start(t)
	ctx := context.Background()
	h := &harness{t: t, c: c, store: bus.NewEventStore(c, events.SourcePlanner, nil), hbs: map[string]agent.Info{}, keys: map[string]nkeys.KeyPair{}}
	var err error
	if h.agents, err = c.JS.KeyValue(ctx, bus.BucketAgents); err != nil {
		t.Fatal(err)
	}
	if h.secret, err = c.JS.KeyValue(ctx, bus.BucketSecrets); err != nil {
		t.Fatal(err)
	}
	if h.health, err = c.JS.KeyValue(ctx, bus.BucketHealth); err != nil {
		t.Fatal(err)
	}
	h.putHealth(ctx)
	// Refresh the fake heartbeats so they outlive the bucket TTL.
	hctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(2 * time.Second)
		defer tk.Stop()
		// The fake health replica renews its key well within the TTL.
		hk := time.NewTicker(bus.HealthMemberTTL / 4)
		defer hk.Stop()
		for {
			select {
			case <-hctx.Done():
				return
			case <-hk.C:
				if !h.noHealth.Load() {
					h.putHealth(hctx)
				}
			case <-tk.C:
				// Under the lock, so a target the test removes is not
				// announced again behind its back.
				h.mu.Lock()
				for _, i := range h.hbs {
					_ = h.putHeartbeat(hctx, i)
				}
				h.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// fakeHealthReplica is the fleet-health key of the harness's fake health
// replica.
const fakeHealthReplica = "test-health"

// putHealth renews the fake health replica's membership.
func (h *harness) putHealth(ctx context.Context) {
	_, _ = h.health.Put(ctx, fakeHealthReplica, []byte(`{"replica":"`+fakeHealthReplica+`"}`))
}

// healthDown stops the fake health replica: its key is left to expire
// (with expire) or deleted, as a replica that leaves cleanly does.
func (h *harness) healthDown(expire bool) {
	h.t.Helper()
	h.noHealth.Store(true)
	if expire {
		return
	}
	if err := h.health.Delete(context.Background(), fakeHealthReplica); err != nil {
		h.t.Fatal(err)
	}
}

// healthUp starts the fake health replica again.
func (h *harness) healthUp() {
	h.noHealth.Store(false)
	h.putHealth(context.Background())
}

// agent announces a live target the way pkg/agent's runtime does.
func (h *harness) agent(info agent.Info) {
	h.t.Helper()
	if info.Type == "" {
		info.Type = "local"
	}
	h.mu.Lock()
	h.hbs[agent.HeartbeatKey(info.Entry, info.Target)] = info
	if h.keys[agent.HeartbeatKey(info.Entry, info.Target)] == nil {
		kp, err := seal.NewKey()
		if err != nil {
			h.t.Fatal(err)
		}
		h.keys[agent.HeartbeatKey(info.Entry, info.Target)] = kp
	}
	h.mu.Unlock()
	if err := h.putHeartbeat(context.Background(), info); err != nil {
		h.t.Fatal(err)
	}
}

// goneAgent removes a target's heartbeat, as a stopping agent does.
func (h *harness) goneAgent(entry, target string) {
	h.t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.hbs, agent.HeartbeatKey(entry, target))
	if err := h.agents.Delete(context.Background(), agent.HeartbeatKey(entry, target)); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) putHeartbeat(ctx context.Context, info agent.Info) error {
	now := time.Now().UTC()
	hb := agent.Heartbeat{Info: info, StartedAt: now, At: now}
	if kp := h.keys[agent.HeartbeatKey(info.Entry, info.Target)]; kp != nil {
		hb.XKey = seal.Public(kp)
	}
	b, _ := json.Marshal(hb)
	_, err := h.agents.Put(ctx, agent.HeartbeatKey(info.Entry, info.Target), b)
	return err
}

func testLogger() *slog.Logger {
	if os.Getenv("PLANNER_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// running is one planner replica started by a test.
type running struct {
	*Planner
	stop func()
}

func (h *harness) startPlanner(id string, tracer trace.Tracer) *running {
	h.t.Helper()
	return h.startPlannerWith(Config{ID: id}, tracer)
}

// startPlannerWith starts a planner with cfg; tweaks adjust it before it
// runs.
func (h *harness) startPlannerWith(cfg Config, tracer trace.Tracer, tweaks ...func(*Planner)) *running {
	h.t.Helper()
	return h.startPlannerMeasured(cfg, tracer, nil, tweaks...)
}

// startPlannerMeasured is startPlannerWith reporting metrics on meter.
func (h *harness) startPlannerMeasured(cfg Config, tracer trace.Tracer, meter metric.Meter, tweaks ...func(*Planner)) *running {
	h.t.Helper()
	id := cfg.ID
	if cfg.ReconcileInterval == 0 {
		cfg.ReconcileInterval = 100 * time.Millisecond
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = 3 * time.Second
	}
	conn := bustest.Dial(h.t, h.c)
	p, err := New(conn, cfg, testLogger(), tracer, meter)
	if err != nil {
		h.t.Fatal(err)
	}
	for _, tw := range tweaks {
		tw(p)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	var once sync.Once
	r := &running{Planner: p, stop: func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				h.t.Errorf("planner %s: Run returned %v", id, err)
			}
		})
	}}
	h.t.Cleanup(r.stop)
	h.waitFor("planner "+id+" ready", p.Ready)
	return r
}

// leader starts one planner and waits until it leads.
func (h *harness) leader() *running {
	h.t.Helper()
	r := h.startPlanner("p1", nil)
	h.waitFor("leader", r.IsLeader)
	return r
}

// folded waits until r's projection holds every event FLEET_EVENTS has
// now: the planner folds asynchronously, so an API read right after the
// test saw an event in the stream may not know of it yet.
func (h *harness) folded(r *running) {
	h.t.Helper()
	last := h.streamSeq(bus.EventsStream)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := r.waitSeq(ctx, last); err != nil {
		h.t.Fatalf("planner projection never reached seq %d: %v", last, err)
	}
}

// settle waits until r has completed n more reconcile rounds after now.
func (h *harness) settle(r *running, n int64) {
	h.t.Helper()
	from := r.rounds.Load()
	h.waitFor("reconcile rounds", func() bool { return r.rounds.Load() >= from+n })
}

func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	testwait.Until(h.t, waitTimeout, what, cond)
}

// reply is an API answer.
type reply struct {
	Code  string // micro error code, "" on success
	Body  []byte
	Error *api.APIError
}

// request sends body as it is to subject with the headers hdr (a trace,
// or nil) and reads the reply with [api.Decode]; an error reply must carry
// its JSON error body.
func (h *harness) request(subject, body string, hdr nats.Header) reply {
	h.t.Helper()
	msg := nats.NewMsg(subject)
	msg.Data = []byte(body)
	if hdr != nil {
		msg.Header = hdr
	}
	// The deciding endpoints are the leader's: while leadership moves,
	// nobody answers them for a moment.
	var resp *nats.Msg
	var err error
	deadline := time.Now().Add(waitTimeout)
	for {
		resp, err = h.c.NC.RequestMsg(msg, 20*time.Second)
		if !errors.Is(err, nats.ErrNoResponders) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var raw json.RawMessage
	err = api.Decode(subject, resp, err, &raw)
	var aerr *api.APIError
	switch {
	case err == nil:
		return reply{Body: raw}
	case resp == nil || !errors.As(err, &aerr):
		h.t.Fatalf("request %s %s: %v", subject, body, err)
	}
	var wrap struct {
		Error *api.APIError `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &wrap); err != nil || wrap.Error == nil {
		h.t.Fatalf("error reply %s without a JSON error body: %q", aerr.Status, resp.Data)
	}
	return reply{Code: aerr.Status, Body: resp.Data, Error: aerr}
}

// ok sends a request that must succeed and decodes its reply into out.
func (h *harness) ok(subject, body string, out any) {
	h.t.Helper()
	r := h.request(subject, body, nil)
	if r.Code != "" {
		h.t.Fatalf("%s %s: got error %s %+v, want success", subject, body, r.Code, r.Error)
	}
	if out != nil {
		if err := json.Unmarshal(r.Body, out); err != nil {
			h.t.Fatalf("%s reply %q: %v", subject, r.Body, err)
		}
	}
}

// lastSeq returns the stream's last sequence. For FLEET_EVENTS it skips
// the planner's terms and fences and pool condition events: a leader
// appends those on its own (when it takes over, with each decision, when a
// pool's condition changes), so "this request appended nothing" compares
// the other events only (they have tests of their own).
func (h *harness) lastSeq(stream string) uint64 {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, stream)
	if err != nil {
		h.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	seq := info.State.LastSeq
	if stream != bus.EventsStream {
		return seq
	}
	for ; seq > 0; seq-- {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			h.t.Fatal(err)
		}
		agg, _, kind, _, _ := events.ParseEventSubject(m.Subject)
		if agg != events.AggregatePlanner && (agg != events.AggregatePool || kind != events.PoolCondition) {
			return seq
		}
	}
	return 0
}

// streamSeq returns the stream's last sequence, every event counted.
func (h *harness) streamSeq(stream string) uint64 {
	h.t.Helper()
	s, err := h.c.JS.Stream(context.Background(), stream)
	if err != nil {
		h.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	return info.State.LastSeq
}

// events returns every domain event in FLEET_EVENTS (not the planner's
// leader terms and fences), read by sequence (no consumer, so polling it is
// cheap).
func (h *harness) events() []bus.Event {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		h.t.Fatal(err)
	}
	var out []bus.Event
	last := h.streamSeq(bus.EventsStream)
	for seq := uint64(1); seq <= last; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue // an expired fence message
		}
		if err != nil {
			h.t.Fatalf("event %d: %v", seq, err)
		}
		agg, id, kind, by, ok := events.ParseEventSubject(m.Subject)
		if !ok {
			h.t.Fatalf("event %d: subject %q", seq, m.Subject)
		}
		if agg == events.AggregatePlanner {
			continue // leader terms and fences are no domain events
		}
		env, err := events.DecodeEnvelope(m.Data)
		if err != nil {
			h.t.Fatalf("event %d: %v", seq, err)
		}
		out = append(out, bus.Event{Envelope: env, Seq: seq, Aggregate: agg, ID: id, Kind: kind, By: by, Header: m.Header})
	}
	return out
}

// lastEventSeq is the sequence of the last domain event that is not a pool
// condition: unlike the stream's last sequence, it does not move when a
// replica opens a leader term or records a condition.
func (h *harness) lastEventSeq() uint64 { return h.lastSeq(bus.EventsStream) }

// eventsOf returns the events of one type, in order.
func (h *harness) eventsOf(aggregate, kind string) []bus.Event {
	var out []bus.Event
	for _, e := range h.events() {
		if e.Aggregate == aggregate && e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// command is one message of FLEET_CMDS.
type command struct {
	Subject string
	Verb    string
	Header  nats.Header
	Time    time.Time            // when it was published
	Create  events.CreateCommand // as sent: secrets sealed
	Delete  events.DeleteCommand
	// Raw is the message as stored in FLEET_CMDS.
	Raw []byte
	// Secrets is a create's sealed box, opened with its agent's key.
	Secrets events.CommandSecrets
}

// commands reads FLEET_CMDS by sequence, without consuming: no agent runs
// in these tests, so every command the planner sent is still there.
func (h *harness) commands() []command {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, bus.CommandsStream)
	if err != nil {
		h.t.Fatal(err)
	}
	var out []command
	last := h.streamSeq(bus.CommandsStream)
	for seq := uint64(1); seq <= last; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			h.t.Fatal(err)
		}
		env, err := events.DecodeEnvelope(m.Data)
		if err != nil {
			h.t.Fatalf("command %d: %v", seq, err)
		}
		c := command{Raw: m.Data, Subject: m.Subject, Verb: m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], Header: m.Header, Time: env.Time}
		switch c.Verb {
		case events.VerbCreate:
			err = env.DecodeData(&c.Create)
			if err == nil && c.Create.Sealed != nil {
				err = h.open(&c)
			}
		case events.VerbDelete:
			err = env.DecodeData(&c.Delete)
		}
		if err != nil {
			h.t.Fatalf("command %d (%s): %v", seq, m.Subject, err)
		}
		out = append(out, c)
	}
	return out
}

// open opens a create's sealed secrets with its agent's key.
func (h *harness) open(c *command) error {
	h.mu.Lock()
	kp := h.keys[agent.HeartbeatKey(c.Create.Entry, c.Create.Target)]
	h.mu.Unlock()
	if kp == nil {
		return errors.New("sealed to an agent this test never announced")
	}
	plain, err := seal.Open(kp, c.Create.Sealed)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(plain, &c.Secrets); err != nil {
		return err
	}
	if c.Secrets.ProxyID != c.Create.ProxyID {
		return errors.New("sealed for another proxy")
	}
	return nil
}

// opened is the create as its agent hands it to the driver: the sealed
// secrets in Auth.Password and UserData.
func (c command) opened() events.CreateCommand {
	out := c.Create
	if out.Auth != nil && c.Secrets.Password != "" {
		a := *out.Auth
		a.Password = c.Secrets.Password
		out.Auth = &a
	}
	if len(c.Secrets.UserData) > 0 {
		out.UserData = c.Secrets.UserData
	}
	out.Sealed = nil
	return out
}

func (h *harness) commandsOf(verb string) []command {
	var out []command
	for _, c := range h.commands() {
		if c.Verb == verb {
			out = append(out, c)
		}
	}
	return out
}

// createsOf waits until a create command was sent for each of ids (the
// planner sends it after the proxy's requested event) and returns the last
// one of each.
func (h *harness) createsOf(ids ...string) map[string]command {
	h.t.Helper()
	out := map[string]command{}
	h.waitFor(fmt.Sprintf("create commands for %v", ids), func() bool {
		clear(out)
		for _, c := range h.commandsOf(events.VerbCreate) {
			if slices.Contains(ids, c.Create.ProxyID) {
				out[c.Create.ProxyID] = c
			}
		}
		return len(out) == len(ids)
	})
	return out
}

// observe appends a fact about a proxy as an agent or the health service
// would: with that writer's source, Msg-Id only, no expectation. The
// agent is the one the proxy's requested event placed it on (local/t1
// for a proxy the planner never requested).
func (h *harness) observe(id, kind string, n uint64, data any) {
	h.t.Helper()
	source := events.AgentSource("local", "t1")
	if kind == events.ProxyReady || kind == events.ProxyUnhealthy {
		source = events.SourceHealth
	} else if req, err := bus.NewEventStore(h.c, "test", nil).LastOf(context.Background(), events.AggregateProxy, id, events.ProxyRequested); err != nil {
		h.t.Fatal(err)
	} else if req != nil {
		var d events.ProxyRequestedData
		if err := req.DecodeData(&d); err != nil {
			h.t.Fatal(err)
		}
		source = events.AgentSource(d.Entry, d.Target)
	}
	if _, err := bus.NewEventStore(h.c, source, nil).Append(context.Background(), events.AggregateProxy, id, kind, events.ProxyEventID(id, kind, n), data, nil); err != nil {
		h.t.Fatal(err)
	}
}

// requested waits until n proxies were requested and returns their data by
// proxy id, in order of request.
func (h *harness) requested(n int) ([]string, map[string]events.ProxyRequestedData) {
	h.t.Helper()
	var evs []bus.Event
	h.waitFor("requested events", func() bool {
		evs = h.eventsOf(events.AggregateProxy, events.ProxyRequested)
		return len(evs) >= n
	})
	if len(evs) != n {
		h.t.Fatalf("got %d requested events, want %d", len(evs), n)
	}
	ids := make([]string, 0, n)
	out := map[string]events.ProxyRequestedData{}
	for _, e := range evs {
		var d events.ProxyRequestedData
		if err := e.DecodeData(&d); err != nil {
			h.t.Fatal(err)
		}
		ids = append(ids, e.ID)
		out[e.ID] = d
	}
	return ids, out
}

// demoPool announces targets of entry local, starts a leader, applies
// pool demo of size proxies and waits until they are requested; it
// returns the leader and what [harness.requested] returns.
func (h *harness) demoPool(size int, targets ...string) (*running, []string, map[string]events.ProxyRequestedData) {
	h.t.Helper()
	for _, target := range targets {
		h.agent(agent.Info{Entry: "local", Target: target})
	}
	r := h.leader()
	h.ok(poolApply, fmt.Sprintf(`{"name":"demo","provider":"local","size":%d}`, size), nil)
	ids, req := h.requested(size)
	return r, ids, req
}

// The operator API's subjects the tests call.
var (
	poolApply    = events.APISubject("pool", "apply")
	poolGet      = events.APISubject("pool", "get")
	poolList     = events.APISubject("pool", "list")
	poolDelete   = events.APISubject("pool", "delete")
	proxyGet     = events.APISubject("proxy", "get")
	proxyList    = events.APISubject("proxy", "list")
	proxyDelete  = events.APISubject("proxy", "delete")
	proxyRecycle = events.APISubject("proxy", "recycle")
	// proxyReportBan is the gateway's ban report.
	proxyReportBan = events.APISubject("proxy", "report-ban")
)

// appendsNothing runs fn, which must append no event (as lastSeq counts
// them); what names fn in the failure.
func (h *harness) appendsNothing(what string, fn func()) {
	h.t.Helper()
	before := h.lastSeq(bus.EventsStream)
	fn()
	if got := h.lastSeq(bus.EventsStream); got != before {
		h.t.Errorf("%s appended: FLEET_EVENTS last seq %d, want %d (unchanged): %s", what, got, before, h.subjects(bus.EventsStream, before+1, got))
	}
}

// subjects lists the subjects of stream's messages from first to last,
// for an error that says what was appended.
func (h *harness) subjects(stream string, first, last uint64) string {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, stream)
	if err != nil {
		h.t.Fatal(err)
	}
	var out []string
	for seq := first; seq <= last; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			out = append(out, fmt.Sprintf("%d: %v", seq, err))
			continue
		}
		out = append(out, fmt.Sprintf("%d: %s", seq, m.Subject))
	}
	return strings.Join(out, ", ")
}

// changesNothing runs fn, which must append no event and send no command
// (a refused request).
func (h *harness) changesNothing(t *testing.T, fn func()) {
	t.Helper()
	evBefore, cmdBefore := h.lastSeq(bus.EventsStream), h.lastSeq(bus.CommandsStream)
	fn()
	if got := h.lastSeq(bus.EventsStream); got != evBefore {
		t.Errorf("FLEET_EVENTS last seq: got %d, want %d (unchanged)", got, evBefore)
	}
	if got := h.lastSeq(bus.CommandsStream); got != cmdBefore {
		t.Errorf("FLEET_CMDS last seq: got %d, want %d (unchanged)", got, cmdBefore)
	}
}

// hasField reports whether e names field.
func hasField(e *api.APIError, field string) bool {
	for _, f := range e.Fields {
		if f.Field == field {
			return true
		}
	}
	return false
}

// equalJSON reports whether a and b encode to the same JSON.
func equalJSON(a, b any) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// bringUp records the agent's and health service's facts for a proxy, up to
// state (running, ready or unhealthy).
func (h *harness) bringUp(id, target, state string) {
	h.t.Helper()
	h.observe(id, events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: target, Instance: events.InstanceName(id), ProviderID: "pid-" + id, Attempt: 1})
	h.observe(id, events.ProxyRunning, 1, events.ProxyRunningData{ProviderID: "pid-" + id, Address: "127.0.0.1:4000", Attempt: 1})
	switch state {
	case events.ProxyReady:
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
	case events.ProxyUnhealthy:
		h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:4000"})
		h.observe(id, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "probe failed", Streak: 3})
	}
}

// waitState waits until r's state holds proxy id in state.
func (h *harness) waitState(r *running, id, state string) {
	h.t.Helper()
	h.waitFor(id+" "+state, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		x := r.st.proxies[id]
		return x != nil && x.State == state
	})
}

// driver plays agent and health service for a rotation test: it brings up
// every requested proxy to ready and reports every retiring one deleted.
type driver struct {
	h    *harness
	done map[string]bool
}

func (d *driver) step() {
	for _, e := range d.h.events() {
		if e.Aggregate != events.AggregateProxy {
			continue
		}
		key := e.ID + "/" + e.Kind
		if d.done[key] {
			continue
		}
		switch e.Kind {
		case events.ProxyRequested:
			var rd events.ProxyRequestedData
			if err := e.DecodeData(&rd); err != nil {
				d.h.t.Fatal(err)
			}
			d.h.bringUp(e.ID, rd.Target, events.ProxyReady)
		case events.ProxyRetiring:
			d.h.observe(e.ID, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		}
		d.done[key] = true
	}
}

// holdLease holds the leader lease for the test, so the planners it starts
// only follow the log (they never lead and decide).
func (h *harness) holdLease() {
	h.t.Helper()
	h.t.Cleanup(holdLeaseOn(h.t, h.c))
}

// follower starts a planner that follows the log (the test holds the
// lease) and never writes snapshots on its own.
func (h *harness) follower(id string) *running {
	h.t.Helper()
	return h.startPlannerWith(Config{ID: id, SnapshotEvery: -1, SnapshotInterval: -1, KeepFinished: testKeep}, nil)
}

// logRecorder keeps the messages a planner logs at warn or above.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelWarn }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Level.String()+" "+r.Message)
	return nil
}

func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// skewedLeader starts a leader whose proxy-age clock (rotation and
// unhealthy durations) runs skew ahead of the wall clock.
func (h *harness) skewedLeader(id string, skew *atomic.Int64, cfg Config) *running {
	h.t.Helper()
	cfg.ID = id
	r := h.startPlannerWith(cfg, nil, func(p *Planner) {
		p.ageNow = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	})
	h.waitFor("leader "+id, r.IsLeader)
	return r
}

// readyPool applies a pool and drives its proxies to ready; it returns
// their ids.
func (h *harness) readyPool(r *running, d *driver, body string, name string, size int) []string {
	h.t.Helper()
	h.ok(poolApply, body, nil)
	h.waitFor(name+" ready", func() bool {
		d.step()
		return r.poolView(name).States[events.ProxyReady] == size
	})
	var ids []string
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var rd events.ProxyRequestedData
		if e.DecodeData(&rd) == nil && rd.Pool == name {
			ids = append(ids, e.ID)
		}
	}
	return ids
}
