package planner

import (
	"time"

	"proxyfleet/services/planner/internal/decide"
)

// reconciler is one leader term's reconciler. It runs on one goroutine
// (reconcileLoop) and owns what only that goroutine touches; a term starts
// with a new one, so nothing of an earlier term's bookkeeping carries
// over. It embeds the planner for what every replica shares: the state,
// the store, the logs and metrics.
type reconciler struct {
	*Planner
	// l is the term it reconciles in.
	l *leadership
	// rules is the rules' tuning, from the planner's Config.
	rules decide.Config

	// ownSeq is the sequence of the last decision it appended: a round
	// waits for the projection to hold it.
	ownSeq uint64
	// outbox holds the commands whose publish failed, to retry with the
	// same Msg-Id, by proxy.
	outbox map[string]pending
	// noTarget is, per pool, when "no target" was last logged.
	noTarget map[string]time.Time
	// timers says when a round looks at a pool no event touched again;
	// lastSweep is when a round last looked at every pool.
	timers    map[string]decide.When
	lastSweep time.Time
	// healthDown is whether health was down at the last round: a change
	// makes the round look at every pool.
	healthDown bool
	// orphanSince and missingSince are the garbage collector's "seen
	// since" times: a new leader starts the grace again.
	orphanSince  map[orphanKey]time.Time
	missingSince map[string]missing
	// lowDemand is, per autoscaled pool, its current stretch of demand
	// below its size: a new leader starts it again.
	lowDemand map[string]decide.LowDemand
	// traced is, per pool, the traceparent of the last request whose
	// trace a round continued (see tracing.go).
	traced map[string]string
	// fileErrs is, per external pool whose file does not read, why (its
	// Placed condition says it).
	fileErrs map[string]string
}

// newReconciler returns the reconciler of term l.
func newReconciler(p *Planner, l *leadership) *reconciler {
	cfg := p.cfg
	return &reconciler{
		Planner: p, l: l,
		rules: decide.Config{CreateTimeout: cfg.CreateTimeout, ProvisionTimeout: cfg.ProvisionTimeout, ReadyTimeout: cfg.ReadyTimeout,
			RetireTimeout: cfg.RetireTimeout, QuotaAvoid: cfg.QuotaAvoid, MaxCreateAttempts: cfg.MaxCreateAttempts, StuckDeletes: cfg.StuckDeletes},
		outbox:       map[string]pending{},
		noTarget:     map[string]time.Time{},
		timers:       map[string]decide.When{},
		orphanSince:  map[orphanKey]time.Time{},
		missingSince: map[string]missing{},
		lowDemand:    map[string]decide.LowDemand{},
		fileErrs:     map[string]string{},
	}
}
