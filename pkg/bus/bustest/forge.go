package bustest

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// AppendOn appends an event of type typ of aggregate/id from source on
// subject, whatever subject source writes on: a forged or misplaced
// event, for the tests of readers that must refuse it. Writers go through
// [bus.EventStore.Append]. It returns the event's stream sequence.
func AppendOn(t testing.TB, c *bus.Conn, subject, source, aggregate, id, typ, msgID string, data any) uint64 {
	t.Helper()
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(aggregate, typ), id, time.Now(), data)
	if err != nil {
		t.Fatal(err)
	}
	body, err := env.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	msg := nats.NewMsg(subject)
	msg.Data = body
	ack, err := c.JS.PublishMsg(t.Context(), msg, jetstream.WithMsgID(msgID))
	if err != nil {
		t.Fatalf("append %s: %v", subject, err)
	}
	return ack.Sequence
}
