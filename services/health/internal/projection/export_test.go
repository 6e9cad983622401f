package projection

import "context"

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
