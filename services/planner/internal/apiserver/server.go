// Package apiserver serves the planner's operator API, the fleet-planner
// micro service on fleet.api.<noun>.<verb>, whose contract is package
// [api]: it reads requests strictly (strict.go), checks them, answers reads
// from the planner's projection and hands decisions to the planner's one
// writer, all through [Backend]. Each reply is traced, counted and cut to
// fit the connection's max payload (paging.go).
//
// The package holds no state of the fleet and decides nothing: what a
// request changes, and whether it may, is the planner's to say.
package apiserver

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// ServiceName is the micro service every planner replica serves.
const ServiceName = "fleet-planner"

// requestTimeout bounds the work behind one API request.
const requestTimeout = 30 * time.Second

// Backend is what the API needs of the planner: reads of its projection
// ([State]) and decisions taken by its one writer ([Writer]).
type Backend interface {
	State
	Writer
}

// State reads the planner's projection of the event log. Every method
// returns copies.
type State interface {
	// Pool returns the view of an applied pool (a deleted one too, while
	// the projection holds it) and whether there is one.
	Pool(name string) (api.PoolView, bool)
	// Pools returns up to n views of the pools an operator can see, in
	// name order, after the pool named after ("" for the first).
	Pools(after string, n int) []api.PoolView
	// Proxies returns up to n live proxies (not deleted or abandoned), of
	// pool or of every pool when pool is "", in id order, after the proxy
	// with id after.
	Proxies(pool, after string, n int) []events.ProxyView
	// Proxy returns the proxy with id, from memory or, finished long ago,
	// folded from the log: a [api.CodeNotFound] refusal when the log holds
	// none.
	Proxy(ctx context.Context, id string) (events.ProxyView, *api.APIError)
	// Targets returns the targets known for entry and whether the entry is
	// known at all. It reads the agents' heartbeats afresh when entry or
	// one of want is not known yet, so an agent that announced itself an
	// instant ago counts.
	Targets(ctx context.Context, entry string, want []string) (targets map[string]bool, known bool)
	// LabelKeys returns the label keys the live targets of entry carry,
	// and whether any target of entry is live (reading the heartbeats
	// afresh when none is).
	LabelKeys(ctx context.Context, entry string) (keys map[string]bool, live bool)
	// Inventory asks the agent of entry/target for the instances it
	// marked; nats.ErrNoResponders when no agent serves it.
	Inventory(ctx context.Context, entry, target string) ([]agent.Instance, error)
}

// Writer takes the operator's decisions through the planner's one writer.
// Each re-reads what it decides from, appends fenced by a planner term and
// answers the view the projection holds once its events are in it;
// repeating a request changes nothing.
type Writer interface {
	// ApplyPool records a checked spec: its secrets, then pool applied
	// with the next revision, unless the pool already holds that spec.
	ApplyPool(ctx context.Context, spec events.PoolSpec) (api.PoolView, *api.APIError)
	// DeletePool records that a pool is deleted and removes its secrets.
	DeletePool(ctx context.Context, name string) (api.PoolView, *api.APIError)
	// Retire retires a proxy as r says.
	Retire(ctx context.Context, id string, r Retirement) (events.ProxyView, *api.APIError)
	// Recycle replaces a proxy surge first.
	Recycle(ctx context.Context, id string) (events.ProxyView, *api.APIError)
	// DeleteInstance retires the proxy inst's marker names (whose proxy is
	// finished or unknown) and sends the delete of inst on entry/target;
	// it returns the delete's attempt.
	DeleteInstance(ctx context.Context, entry, target string, inst agent.Instance) (int, *api.APIError)
}

// Retirement says how the operator retires a proxy.
type Retirement struct {
	// Reason is recorded in the retiring event ("deleted by operator",
	// "banned: <reason>").
	Reason string
	// SkipCleanup abandons the proxy without touching its instance.
	SkipCleanup bool
	// Replace requests the proxy's replacement in the same batch as its
	// retirement (a ban: the pool does not wait for a round).
	Replace bool
}

// Role is which endpoints an instance of the service serves.
type Role string

const (
	// Replica serves what any replica can answer: the reads and the
	// operator's intents (pool.apply, pool.delete).
	Replica Role = "replica"
	// Leader serves the endpoints that decide from the fleet's state
	// (proxy.delete, proxy.recycle, proxy.report-ban, instance.delete):
	// only the leader takes those, so NATS routes them to it.
	Leader Role = "leader"
)

// deciding are the endpoints only the leader serves.
var deciding = map[string]bool{
	"proxy.delete": true, "proxy.recycle": true, "proxy.report-ban": true, "instance.delete": true,
}

// Server is the operator API of one planner replica.
type Server struct {
	b      Backend
	nc     *nats.Conn
	id     string
	log    *slog.Logger
	tracer trace.Tracer

	requests metric.Int64Counter
	duration metric.Float64Histogram
}

// Config is what a [Server] is made of besides its backend and connection.
type Config struct {
	// ID names the replica in the service's metadata.
	ID     string
	Log    *slog.Logger
	Tracer trace.Tracer
	Meter  metric.Meter
	// Buckets are the boundaries of the request duration histogram, in
	// seconds.
	Buckets []float64
}

// New returns the API over b, served on nc.
func New(b Backend, nc *nats.Conn, cfg Config) (*Server, error) {
	s := &Server{b: b, nc: nc, id: cfg.ID, log: cfg.Log, tracer: cfg.Tracer}
	meter, buckets := cfg.Meter, cfg.Buckets
	var err error
	if s.requests, err = meter.Int64Counter("proxyfleet.api.requests", metric.WithUnit("{request}"),
		metric.WithDescription("Operator API requests, by endpoint (pool.apply, …) and code (ok, or the error code: 400, 404, 409, 422, 500, 503)")); err != nil {
		return nil, err
	}
	if s.duration, err = meter.Float64Histogram("proxyfleet.api.request.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of one operator API request, by endpoint"),
		metric.WithExplicitBucketBoundaries(buckets...)); err != nil {
		return nil, err
	}
	return s, nil
}

type handlerFunc func(ctx context.Context, body []byte) (any, *api.APIError)

// Start adds an instance of the fleet-planner micro service with the
// endpoints of role; stopping it is the caller's.
func (s *Server) Start(role Role) (micro.Service, error) {
	svc, err := micro.AddService(s.nc, micro.Config{
		Name:        ServiceName,
		Version:     buildinfo.Version,
		Description: "proxyfleet planner: pool and proxy intent",
		Metadata:    map[string]string{"replica": s.id, "role": string(role)},
	})
	if err != nil {
		return nil, err
	}
	endpoints := []struct {
		noun, verb string
		fn         handlerFunc
	}{
		{api.NounPool, api.VerbApply, s.poolApply},
		{api.NounPool, api.VerbGet, s.poolGet},
		{api.NounPool, api.VerbList, s.poolList},
		{api.NounPool, api.VerbDelete, s.poolDelete},
		{api.NounProxy, api.VerbGet, s.proxyGet},
		{api.NounProxy, api.VerbList, s.proxyList},
		{api.NounProxy, api.VerbDelete, s.proxyDelete},
		{api.NounProxy, api.VerbRecycle, s.proxyRecycle},
		{api.NounProxy, api.VerbReportBan, s.proxyReportBan},
		{api.NounInstance, api.VerbDelete, s.instanceDelete},
	}
	groups := map[string]micro.Group{}
	for _, e := range endpoints {
		if deciding[e.noun+"."+e.verb] != (role == Leader) {
			continue
		}
		g := groups[e.noun]
		if g == nil {
			g = svc.AddGroup(events.APIGroup(e.noun))
			groups[e.noun] = g
		}
		// Endpoint names are "<noun>-<verb>", unique in the service, so
		// nats micro info tells pool.get from proxy.get.
		if err := g.AddEndpoint(e.noun+"-"+e.verb, s.handler(e.noun+"."+e.verb, e.fn), micro.WithEndpointSubject(e.verb)); err != nil {
			_ = svc.Stop()
			return nil, fmt.Errorf("endpoint %s: %w", events.APISubject(e.noun, e.verb), err)
		}
	}
	return svc, nil
}

// handler runs fn in the trace the request carries (a trace of its own
// when it carries none), writes its reply and counts it. A refusal of the
// request (4xx) is the API working: only a 5xx marks the span failed.
func (s *Server) handler(name string, fn handlerFunc) micro.Handler {
	endpoint := metric.WithAttributes(attribute.String("endpoint", name))
	return micro.HandlerFunc(func(req micro.Request) {
		start := time.Now()
		ctx := telemetry.Extract(context.Background(), nats.Header(req.Headers()))
		ctx, span := s.tracer.Start(ctx, "planner.api."+name, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(telemetry.MessagingAttrs("process", req.Subject(), "")...),
			trace.WithAttributes(attribute.String("rpc.system", "nats-micro"), attribute.String("rpc.method", name)))
		defer span.End()
		code := "ok"
		defer func() {
			span.SetAttributes(attribute.String("proxyfleet.api.code", code))
			s.requests.Add(ctx, 1, endpoint, metric.WithAttributes(attribute.String("code", code)))
			s.duration.Record(ctx, time.Since(start).Seconds(), endpoint)
		}()
		ctx, cancel := context.WithTimeout(ctx, requestTimeout)
		defer cancel()
		out, aerr := fn(ctx, req.Data())
		var body []byte
		if aerr == nil {
			body, aerr = encodeReply(out, s.ReplyBudget())
		}
		if aerr != nil {
			code = aerr.Status
			level := s.log.InfoContext
			if strings.HasPrefix(aerr.Status, "5") {
				span.SetStatus(codes.Error, aerr.Code+": "+aerr.Message)
			}
			if aerr.Status == "500" {
				level = s.log.ErrorContext
			}
			level(ctx, "request refused", "endpoint", name, "code", aerr.Status, "error", aerr.Message)
			if err := req.Error(aerr.Status, aerr.Message, api.ErrorBody(aerr)); err != nil {
				s.log.Warn("reply", "endpoint", name, "err", err)
			}
			return
		}
		if err := req.Respond(body); err != nil {
			s.log.Warn("reply", "endpoint", name, "err", err)
		}
	})
}

// encodeReply encodes a reply and refuses one over budget (see
// [Server.ReplyBudget]): the server would drop it and the client would
// wait for nothing. List replies are built to fit (see paging.go); this
// catches any other.
func encodeReply(out any, budget int) ([]byte, *api.APIError) {
	body, ok := out.(json.RawMessage)
	if !ok {
		var err error
		if body, err = json.Marshal(out); err != nil {
			return nil, api.Internal("could not encode the reply; retry")
		}
	}
	if len(body) > budget {
		return nil, api.Internal(fmt.Sprintf("the reply (%d bytes) does not fit under the server's max payload (%d bytes)", len(body), budget))
	}
	return body, nil
}
