package planner

import (
	"context"

	"proxyfleet/pkg/bus"
)

// Leader fencing.
//
// The lease in KV fleet-planner elects the leader, but a lease alone cannot
// stop a leader that was paused (SIGSTOP, a long GC or VM pause) past its
// TTL and resumes while another replica leads: it still believes it leads
// until it next looks at the lease, and anything it was about to publish
// goes out when it resumes. So a replica that acquires the lease first opens
// a term in the event log ([bus.EventStore.ClaimTerm]), and every reconciler
// decision is a fenced batch ([bus.EventStore.StartFenced], sent by
// [flight.decide]), which the server stores only while that term is the
// latest one. A leader whose fenced batch is refused is deposed: it stops
// its reconciler at once and gives the lease back (if it still holds it),
// and the replicas compete again.

// leadership is one term of this replica as leader.
type leadership struct {
	term bus.Term
	// cancel stops the reconciler of this term.
	cancel context.CancelFunc
	// jobs carries the operator's decisions to the term's reconciler
	// (see [Planner.asLeader]); ended is closed when the reconciler
	// returned.
	jobs  chan leaderJob
	ended chan struct{}
}

// startTerm opens a leader term for the lease at revision lease and starts
// the reconciler of that term. done is closed when the reconciler returned.
func (p *Planner) startTerm(ctx context.Context, lease uint64) (l *leadership, done chan struct{}, err error) {
	term, err := p.store.ClaimTerm(ctx, p.cfg.ID, lease)
	if err != nil {
		return nil, nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	l = &leadership{term: term, cancel: cancel, jobs: make(chan leaderJob), ended: make(chan struct{})}
	p.lease.leading.Store(l)
	p.log.Info("leader lease acquired; reconciling", "term", term.Number, "termSeq", term.Seq, "lease", lease)
	done = make(chan struct{})
	go func() {
		defer close(done)
		defer close(l.ended)
		// Every decision of an earlier term precedes this term's event
		// in the log (later ones are refused), so a projection that
		// holds the term event holds them all: decide only from there.
		if err := p.waitSeq(rctx, term.Seq); err != nil {
			return
		}
		newReconciler(p, l).reconcileLoop(rctx)
	}()
	return l, done, nil
}

// depose ends term l of this replica: its reconciler stops deciding at once
// and lead gives the lease back. Only the first call for a term acts.
func (p *Planner) depose(l *leadership, why string) {
	if !p.lease.leading.CompareAndSwap(l, nil) {
		return
	}
	p.log.Warn("deposed: no longer reconciling", "term", l.term.Number, "why", why)
	l.cancel()
	select {
	case p.lease.deposed <- l:
	default:
	}
}

// noteTerm is called for every term event the projection reads: a term
// newer than this replica's own means another replica leads now.
func (p *Planner) noteTerm(seq uint64) {
	if l := p.lease.leading.Load(); l != nil && seq > l.term.Seq {
		p.depose(l, "another replica opened a newer planner term")
	}
}
