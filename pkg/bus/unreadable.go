package bus

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Unreadable events.
//
// Every writer is checked by the server's permissions, not by what it
// writes: a message on FLEET_EVENTS may hold anything, even nothing. Every
// reader treats one whose envelope does not decode the same way: it is
// logged once, counted (proxyfleet.events.unreadable, by the reader's
// source) and never acted on. A read ([EventStore.Follow], Replay, Load)
// still delivers it, as an [Event] whose Unreadable is set and whose
// Envelope is empty, so that a reader that appends decisions expecting an
// aggregate's last sequence can note its sequence; a lookup of the last
// event ([EventStore.Last], LastSeenBy, LastOf, LastObservation) answers
// the last one that reads, so an unreadable message never blocks a
// command.

// unreadableCounter counts unreadable events; it is created on the
// global meter provider, which each service's telemetry sets.
var unreadableCounter = sync.OnceValue(func() metric.Int64Counter {
	c, _ := otel.Meter("proxyfleet/bus").Int64Counter("proxyfleet.events.unreadable", metric.WithUnit("{event}"),
		metric.WithDescription("Messages on FLEET_EVENTS whose envelope does not decode, by the reading service's source; they are skipped"))
	return c
})

// noteUnreadable logs and counts one unreadable message.
func (s *EventStore) noteUnreadable(ctx context.Context, seq uint64, subject string, err error) {
	s.log.Error("skipping an unreadable event", "seq", seq, "subject", subject, "err", err)
	if c := unreadableCounter(); c != nil {
		c.Add(ctx, 1, metric.WithAttributes(attribute.String("reader", s.source)))
	}
}
