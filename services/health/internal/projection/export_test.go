package projection

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
)

// Raw is one stored FLEET_EVENTS message, for [Projector.ApplyBatch].
type Raw struct {
	Seq     uint64
	Subject string
	Data    []byte
}

// ApplyBatch applies evs as one batch, as [Projector.Run] applies the
// messages of one delivery.
func (p *Projector) ApplyBatch(ctx context.Context, evs []Raw) error {
	prepared := make([]event, len(evs))
	for i, e := range evs {
		prepared[i] = p.prepare(e.Seq, e.Subject, e.Data, nil)
	}
	return p.apply(ctx, prepared)
}

// SetCrash sets the crash test hook (see Projector.crash).
func (p *Projector) SetCrash(f func(wave int, bucket, key string) bool) { p.crash = f }

// ErrCrashed is what a batch the crash hook stopped returns.
var ErrCrashed = errCrashed

// SetReplayKeys sets how many keys a batch of a replay holds, and how many
// events it folds at a time.
func (p *Projector) SetReplayKeys(n int) { p.replayKeys = n }

// ReplayWith is Replay applying the log through p.
func ReplayWith(ctx context.Context, p *Projector) error {
	if err := Rebuild(ctx, p.conn); err != nil {
		return err
	}
	st, err := p.conn.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		return err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return err
	}
	return p.replayAll(ctx, st, info.State.LastSeq)
}

// PullAndForget starts pulling from the projection's consumer as
// [Projector.Run] does, stops, and returns once the server has forgotten
// the pull requests, as Run does before a reset.
func (p *Projector) PullAndForget(ctx context.Context) error {
	cons, err := EnsureConsumer(ctx, p.conn)
	if err != nil {
		return err
	}
	it, err := cons.Messages(jetstream.PullPriorityGroup(PriorityGroup),
		jetstream.PullMaxMessages(maxAckPending), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return err
	}
	src := newSource(p, it, "", maxAckPending)
	src.stop()
	src.forgotten()
	return nil
}

// StopWait is how long a stopped pull waits at most for its unsubscribe.
const StopWait = stopWait

// SetStall sets how long a pinned projector may receive nothing while
// events wait before it gives the pin up.
func (p *Projector) SetStall(d time.Duration) { p.stallAfter = d }

// SetDeaf sets the deaf test hook (see Projector.deaf).
func (p *Projector) SetDeaf(f func() bool) { p.deaf = f }

// SetDirectGet sends the direct gets of the proxies' view to subject, for
// a test that answers some of them as a replica from behind would.
func (p *Projector) SetDirectGet(subject string) { p.proxies.direct = subject }

// DirectGetProxies is the subject the proxies' view is read from.
const DirectGetProxies = directGetPrefix + "KV_" + bus.BucketProxies
