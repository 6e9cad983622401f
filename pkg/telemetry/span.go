package telemetry

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Messaging spans.
//
// Every span of a unit of work that sends or handles one NATS message
// carries the OTel semantic-convention messaging attributes, built by
// [MessagingAttrs], so that every service's spans can be queried alike:
// messaging.system "nats", messaging.destination.name the subject,
// messaging.operation.type and .name what the span does with it.

// Operation types of messaging spans (messaging.operation.type).
const (
	// OpPublish is appending an event or publishing a command that the
	// publisher decided (the planner's).
	OpPublish = "publish"
	// OpSend is appending an observation (an agent's, health's).
	OpSend = "send"
	// OpProcess is handling a message received: a command in an agent,
	// a request in the planner's API.
	OpProcess = "process"
)

// Semantic-convention attribute keys of messaging spans, beside those
// [MessagingAttrs] sets.
const (
	// AttrMessageID is the message's Nats-Msg-Id.
	AttrMessageID = attribute.Key("messaging.message.id")
	// AttrConsumerGroup is the durable consumer a message was taken from.
	AttrConsumerGroup = attribute.Key("messaging.consumer.group.name")
)

// MessagingAttrs are the attributes of a span that does op (one of
// [OpPublish], [OpSend], [OpProcess]) with one message on subject.
// template, when not empty, is the subject with its variable parts named
// (messaging.destination.template), e.g. "fleet.cmd.{entry}.{target}.create".
func MessagingAttrs(op, subject, template string) []attribute.KeyValue {
	a := []attribute.KeyValue{
		attribute.String("messaging.system", "nats"),
		attribute.String("messaging.destination.name", subject),
		attribute.String("messaging.operation.type", op),
		attribute.String("messaging.operation.name", op),
	}
	if template != "" {
		a = append(a, attribute.String("messaging.destination.template", template))
	}
	return a
}

// Why a span links to another (the proxyfleet.link attribute of the link).
const (
	// LinkCausedBy links work decided later (a replacement, a timeout, a
	// rotation) to the request that caused it.
	LinkCausedBy = "caused-by"
	// LinkRequested links an observation about a proxy (health's ready or
	// unhealthy) to the request that asked for the proxy.
	LinkRequested = "requested"
)

// AttrLink says, on a span link, why the span links there: [LinkCausedBy]
// or [LinkRequested].
const AttrLink = attribute.Key("proxyfleet.link")

// NewRootLinkedTo are the options that start a span as the root of a
// trace of its own, linked to cause (the span of the request the work
// stems from) for the reason why. Work that happens long after its request
// gets a trace of its own instead of growing the request's for as long as
// a pool or a proxy lives; the link leads from one to the other. Without a
// valid cause the span is a root with no link.
func NewRootLinkedTo(cause trace.SpanContext, why string) []trace.SpanStartOption {
	opts := []trace.SpanStartOption{trace.WithNewRoot()}
	if cause.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: cause, Attributes: []attribute.KeyValue{AttrLink.String(why)}}))
	}
	return opts
}
