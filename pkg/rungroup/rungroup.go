// Package rungroup is the life of one service process: a [Group] starts the
// process's long-running parts together, and stops them all when its
// context ends (SIGINT or SIGTERM: see [SignalContext]) or when the first
// of them returns, in the reverse order they were added, each within a
// bound; the first error wins.
//
// Every cmd/<svc>/main.go runs its parts in one Group: configure, connect
// (pkg/service), add the parts, Run, then close the connections. Add a
// part's dependencies before it: the loops before the API that serves
// their state, the echo endpoint before the probes that fetch it. The
// part added last stops first, as deferred calls do.
package rungroup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

// DefaultStopTimeout is how long the members added by one [Group.Add]
// may take to return once asked to stop, unless [Group.StopTimeout] says
// otherwise.
const DefaultStopTimeout = 30 * time.Second

// ErrStopTimeout is the error of a member that did not return within the
// stop bound: it ignores its context, or its stop hangs. [Group.Run]
// returns without waiting for it any longer.
var ErrStopTimeout = errors.New("did not stop")

// Member is one long-running part of a process.
type Member struct {
	// Name names the member in errors and logs, e.g. "probe".
	Name string
	// Run serves until its context ends (or until Stop, when set), and
	// returns nil or the context's error then. Returning earlier, even
	// with nil, stops the whole group: a process does not go on half
	// serving.
	Run func(ctx context.Context) error
	// Stop, when set, also asks Run to return, for a part that is stopped
	// by a call rather than by its context (an [http.Server]'s Shutdown).
	// Its context ends at the stop bound; its error is logged.
	Stop func(ctx context.Context) error
}

// Group runs the members of one process. The zero value is ready to use;
// add every member before [Group.Run], which may be called once.
type Group struct {
	// StopTimeout bounds the stop of the members of each [Group.Add]; zero
	// means [DefaultStopTimeout].
	StopTimeout time.Duration
	// Log receives why the group stops and what failed while it stopped;
	// nil discards it.
	Log *slog.Logger

	stages [][]Member
}

// Add adds members that start together and, when the group stops, are
// stopped together: after the members of every later Add have returned,
// before those of every earlier one.
func (g *Group) Add(members ...Member) {
	g.stages = append(g.stages, members)
}

// Go adds one member that runs fn until its context ends.
func (g *Group) Go(name string, fn func(ctx context.Context) error) {
	g.Add(Member{Name: name, Run: fn})
}

// done is one member's return.
type done struct {
	stage int
	name  string
	err   error
}

// Run starts every member and serves until ctx ends or a member returns.
// Then it stops the members stage by stage, the last added first: it
// cancels their context, calls their Stop, and waits for them to return,
// at most the stop bound each stage (a member still running then is
// reported with [ErrStopTimeout] and left behind).
//
// Run returns the first error: that of the member whose return stopped
// the group, else the first error of a member while stopping. An error
// wrapping [context.Canceled] from a member asked to stop is a clean stop.
// Errors are named by their member: "probe: <err>".
func (g *Group) Run(ctx context.Context) error {
	log := g.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	bound := g.StopTimeout
	if bound <= 0 {
		bound = DefaultStopTimeout
	}
	// Members keep ctx's values but not its end: they are stopped in
	// order, not all at once when the signal comes.
	base := context.WithoutCancel(ctx)
	cancels := make([]context.CancelFunc, len(g.stages))
	running := make([]int, len(g.stages))
	results := make(chan done, max(1, g.members()))
	for i, stage := range g.stages {
		var sctx context.Context
		sctx, cancels[i] = context.WithCancel(base)
		defer cancels[i]()
		running[i] = len(stage)
		for _, m := range stage {
			go func() { results <- done{stage: i, name: m.Name, err: m.Run(sctx)} }()
		}
	}

	var first error
	stopping := false
	// note records one member's return.
	note := func(d done) {
		running[d.stage]--
		switch {
		case d.err == nil:
			if !stopping {
				log.Info("stopping", "cause", d.name+" returned")
			}
		case stopping && errors.Is(d.err, context.Canceled):
			log.Debug("stopped", "member", d.name, "err", d.err)
		case first == nil:
			first = fmt.Errorf("%s: %w", d.name, d.err)
			if !stopping {
				log.Info("stopping", "cause", first.Error())
			}
		default:
			log.Error("failed while stopping", "member", d.name, "err", d.err)
		}
	}

	if g.members() > 0 {
		select {
		case <-ctx.Done():
			log.Info("stopping", "cause", context.Cause(ctx).Error())
		case d := <-results:
			note(d)
		}
	}
	stopping = true
	for i := len(g.stages) - 1; i >= 0; i-- {
		if err := g.stop(i, cancels[i], bound, results, running, note, log); err != nil {
			if first == nil {
				first = err
			} else {
				log.Error("stop", "err", err)
			}
		}
	}
	return first
}

// stop stops stage i and waits for its members, noting every return
// (those of earlier stages too) until they have all returned or bound
// has passed.
func (g *Group) stop(i int, cancel context.CancelFunc, bound time.Duration, results <-chan done, running []int, note func(done), log *slog.Logger) error {
	timer := time.NewTimer(bound)
	defer timer.Stop()
	cancel()
	// Buffered: a stop still running at the bound does not block on it.
	stopped := make(chan struct{}, len(g.stages[i]))
	stops := 0
	for _, m := range g.stages[i] {
		if m.Stop == nil {
			continue
		}
		stops++
		go func() {
			sctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			if err := m.Stop(sctx); err != nil {
				log.Warn("stop", "member", m.Name, "err", err)
			}
			stopped <- struct{}{}
		}()
	}
	for running[i] > 0 || stops > 0 {
		select {
		case d := <-results:
			note(d)
		case <-stopped:
			stops--
		case <-timer.C:
			return fmt.Errorf("%s: %w within %s", g.names(i), ErrStopTimeout, bound)
		}
	}
	return nil
}

func (g *Group) members() int {
	n := 0
	for _, s := range g.stages {
		n += len(s)
	}
	return n
}

// names names the members of stage i.
func (g *Group) names(i int) string {
	names := make([]string, len(g.stages[i]))
	for j, m := range g.stages[i] {
		names[j] = m.Name
	}
	return strings.Join(names, ", ")
}

// SignalContext returns a context that ends on SIGINT or SIGTERM, for the
// whole life of a service: its start-up and its [Group.Run]. Its cause
// ([context.Cause]) names the signal.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}
