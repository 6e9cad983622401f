package bus

import (
	"log/slog"

	"proxyfleet/pkg/events"
)

// DefaultRejectsLimit is how many rejected aggregates a [Rejects] remembers.
const DefaultRejectsLimit = 1024

// Rejects reports events a reader of FLEET_EVENTS refuses to fold (see
// [events.CheckEvent]: an aggregate id that breaks the identifier rule, an
// event type from the wrong writer), once per aggregate and reason, so a
// flood of bad events costs one log line per offender rather than one per
// event. It remembers at most its limit of keys; when full it forgets them
// all, which bounds memory and reports a persistent offender again now and
// then.
//
// A Rejects is not safe for concurrent use.
type Rejects struct {
	log   *slog.Logger
	limit int
	seen  map[string]struct{}
}

// NewRejects returns a Rejects logging to log (nil: discard) and
// remembering up to limit keys (limit < 1: [DefaultRejectsLimit]).
func NewRejects(log *slog.Logger, limit int) *Rejects {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if limit < 1 {
		limit = DefaultRejectsLimit
	}
	return &Rejects{log: log, limit: limit, seen: map[string]struct{}{}}
}

// Report logs that the event at seq on aggregate/id of type typ, written
// by source, was skipped for fe, unless the same aggregate was already
// reported for a problem with the same field. It reports whether it logged.
func (r *Rejects) Report(seq uint64, aggregate, id, typ, source string, fe *events.FieldError) bool {
	key := aggregate + "\x00" + id + "\x00" + fe.Field
	if _, ok := r.seen[key]; ok {
		return false
	}
	if len(r.seen) >= r.limit {
		clear(r.seen)
	}
	r.seen[key] = struct{}{}
	r.log.Warn("skipping events that break the event contract (reported once per aggregate)",
		"seq", seq, "aggregate", aggregate, "id", id, "type", typ, "source", source, "err", fe)
	return true
}
