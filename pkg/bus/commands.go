package bus

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// PublishCreate publishes cmd to its agent's create subject. See
// [PublishCommand].
func PublishCreate(ctx context.Context, c *Conn, source string, cmd events.CreateCommand, ttl time.Duration) (uint64, error) {
	return PublishCommand(ctx, c, source, cmd.Entry, cmd.Target, events.VerbCreate, cmd.MsgID(), cmd, ttl)
}

// PublishDelete publishes cmd to its agent's delete subject. See
// [PublishCommand].
func PublishDelete(ctx context.Context, c *Conn, source string, cmd events.DeleteCommand, ttl time.Duration) (uint64, error) {
	return PublishCommand(ctx, c, source, cmd.Entry, cmd.Target, events.VerbDelete, cmd.MsgID(), cmd, ttl)
}

// PublishCommand appends a command envelope (CloudEvents type
// "proxyfleet.cmd.<verb>.v1", id msgID) to FLEET_CMDS on
// fleet.cmd.<entry>.<target>.<verb>, with Nats-Msg-Id msgID so a retried
// publish inside the duplicate window is dropped, the trace context of ctx,
// and a per-message TTL (0 means [CommandTTL]) after which an unconsumed
// command expires. It returns the stream sequence.
func PublishCommand(ctx context.Context, c *Conn, source, entry, target, verb, msgID string, data any, ttl time.Duration) (uint64, error) {
	if ttl <= 0 {
		ttl = CommandTTL
	}
	subject := events.CommandSubject(entry, target, verb)
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType("cmd", verb), msgID, time.Now(), data)
	if err != nil {
		return 0, err
	}
	body, err := env.MarshalJSON()
	if err != nil {
		return 0, err
	}
	msg := nats.NewMsg(subject)
	msg.Data = body
	telemetry.Inject(ctx, msg.Header)
	ack, err := c.JS.PublishMsg(ctx, msg, jetstream.WithMsgID(msgID), jetstream.WithMsgTTL(ttl))
	if err != nil {
		return 0, fmt.Errorf("publish %s: %w", subject, err)
	}
	return ack.Sequence, nil
}
