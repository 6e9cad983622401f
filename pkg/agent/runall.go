package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// Runner serves until its context ends; a [*Runtime] is one. String names
// it in its error.
type Runner interface {
	Run(ctx context.Context) error
	fmt.Stringer
}

var _ Runner = (*Runtime)(nil)

// String names the runtime by its entry and target: "agent <entry>.<target>".
func (r *Runtime) String() string {
	return "agent " + HeartbeatKey(r.cfg.Info.Entry, r.cfg.Info.Target)
}

// RunAll runs every runner of one process (an agent serving several
// targets) until ctx ends. The first to fail stops the others, so a
// supervisor restarts the process whole rather than leave it half serving.
// RunAll returns when all have returned, with every failure joined, each
// named by its runner.
func RunAll(ctx context.Context, runners ...Runner) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(runners))
	var wg sync.WaitGroup
	for i, r := range runners {
		wg.Go(func() {
			if err := r.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("%s: %w", r, err)
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
