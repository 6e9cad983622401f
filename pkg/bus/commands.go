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
	msg, opts, err := commandMsg(ctx, source, entry, target, verb, msgID, data, ttl)
	if err != nil {
		return 0, err
	}
	ack, err := c.JS.PublishMsg(ctx, msg, opts...)
	if err != nil {
		return 0, fmt.Errorf("publish %s: %w", msg.Subject, err)
	}
	return ack.Sequence, nil
}

// StartCreate is [PublishCreate] without waiting: see [StartCommand].
func StartCreate(ctx context.Context, c *Conn, source string, cmd events.CreateCommand, ttl time.Duration) (jetstream.PubAckFuture, error) {
	return StartCommand(ctx, c, source, cmd.Entry, cmd.Target, events.VerbCreate, cmd.MsgID(), cmd, ttl)
}

// StartDelete is [PublishDelete] without waiting: see [StartCommand].
func StartDelete(ctx context.Context, c *Conn, source string, cmd events.DeleteCommand, ttl time.Duration) (jetstream.PubAckFuture, error) {
	return StartCommand(ctx, c, source, cmd.Entry, cmd.Target, events.VerbDelete, cmd.MsgID(), cmd, ttl)
}

// StartCommand is [PublishCommand] without waiting for the acknowledgement,
// so a caller may have many commands in flight: the future reports the
// stream's acknowledgement or its error, and the caller must read it.
func StartCommand(ctx context.Context, c *Conn, source, entry, target, verb, msgID string, data any, ttl time.Duration) (jetstream.PubAckFuture, error) {
	msg, opts, err := commandMsg(ctx, source, entry, target, verb, msgID, data, ttl)
	if err != nil {
		return nil, err
	}
	f, err := c.JS.PublishMsgAsync(msg, opts...)
	if err != nil {
		return nil, fmt.Errorf("publish %s: %w", msg.Subject, err)
	}
	return f, nil
}

// commandMsg builds the message of a command and its publish options.
func commandMsg(ctx context.Context, source, entry, target, verb, msgID string, data any, ttl time.Duration) (*nats.Msg, []jetstream.PublishOpt, error) {
	if ttl <= 0 {
		ttl = CommandTTL
	}
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType("cmd", verb), msgID, time.Now(), data)
	if err != nil {
		return nil, nil, err
	}
	body, err := env.MarshalJSON()
	if err != nil {
		return nil, nil, err
	}
	msg := nats.NewMsg(events.CommandSubject(entry, target, verb))
	msg.Data = body
	telemetry.Inject(ctx, msg.Header)
	return msg, []jetstream.PublishOpt{jetstream.WithMsgID(msgID), jetstream.WithMsgTTL(ttl)}, nil
}
