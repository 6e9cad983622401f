package planner

import (
	"context"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/telemetry"
)

// Traces.
//
// Each operator request is one trace: the API's server span (continuing
// the caller's traceparent, if any) and what the request does before it
// answers. The reconciler's first look at a pool after a request's event
// (pool applied or deleted) belongs to that request: the creates of the
// fill, the retirements and deletes of a pool.delete continue its trace.
// Work decided later — replacements, timeouts, rotations, re-issued
// commands, autoscaling, a new leader's re-published commands — starts a
// trace of its own, whose root span links to the span of the request that
// caused it: a trace ends with its request's effects instead of growing
// for as long as the pool lives.
//
// Publishing a command or an event is a producer span with the messaging
// attributes (OTel semantic conventions); its context is what the message
// carries, so the consumer's span (the agent's, health's) is its child.

// traceCtx continues the trace whose W3C traceparent is tp.
func traceCtx(ctx context.Context, tp string) context.Context {
	if tp == "" {
		return ctx
	}
	return telemetry.Extract(ctx, nats.Header{"traceparent": []string{tp}})
}

// causeKey carries, in a context, the span context of the request that
// caused later work: [Planner.startWork] links to it from a new root.
type causeKey struct{}

// causedBy returns ctx for work that the request whose traceparent is tp
// caused earlier: spans started under it by [Planner.startWork] are new
// roots linking to the request's span.
func causedBy(ctx context.Context, tp string) context.Context {
	// Drop a parent ctx might carry: the work is a trace of its own.
	ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	sc := trace.SpanContextFromContext(traceCtx(context.Background(), tp))
	if !sc.IsValid() {
		return ctx
	}
	return context.WithValue(ctx, causeKey{}, sc)
}

// startWork starts the span of one unit of work. Under [causedBy] it is a
// new root with a link to the cause; spans started under the returned
// context are its children as usual.
func (p *Planner) startWork(ctx context.Context, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	opts := []trace.SpanStartOption{trace.WithSpanKind(kind), trace.WithAttributes(attrs...)}
	if sc, ok := ctx.Value(causeKey{}).(trace.SpanContext); ok {
		opts = append(opts, telemetry.NewRootLinkedTo(sc, telemetry.LinkCausedBy)...)
		ctx = context.WithValue(ctx, causeKey{}, nil)
	}
	return p.tracer.Start(ctx, name, opts...)
}

// startPublish starts the producer span of publishing one message on
// subject (template is the subject with its variable parts named, which
// also names the span).
func (p *Planner) startPublish(ctx context.Context, subject, template string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return p.startWork(ctx, "publish "+template, trace.SpanKindProducer, append(telemetry.MessagingAttrs("publish", subject, template), attrs...)...)
}

// poolCtx is the context of the work a round decides for pool: the first
// round after the pool's last request continues that request's trace;
// later rounds start traces of their own linking to it. Reconciler
// goroutine only.
func (rc *reconciler) poolCtx(ctx context.Context, pool Pool) context.Context {
	if pool.traceparent != "" && rc.traced[pool.Name] != pool.traceparent {
		if rc.traced == nil {
			rc.traced = map[string]string{}
		}
		rc.traced[pool.Name] = pool.traceparent
		return traceCtx(ctx, pool.traceparent)
	}
	return causedBy(ctx, pool.traceparent)
}

// noteTraced records as handled every pool's last request that precedes
// the term's event (at termSeq): a new leader links to what an earlier
// leader may have handled already, and continues the requests made since
// its term began (it decides only once the projection holds its term
// event, and a request can come in between).
func (rc *reconciler) noteTraced(termSeq uint64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.traced = make(map[string]string, len(rc.st.pools))
	for name, pl := range rc.st.pools {
		if pl.traceSeq <= termSeq {
			rc.traced[name] = pl.traceparent
		}
	}
}

// failSpan ends span as failed with err.
func failSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
	span.End()
}
