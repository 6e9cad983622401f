package agent

import (
	"context"
	"fmt"

	"proxyfleet/pkg/rungroup"
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
// targets) until ctx ends, as one stage of a [rungroup.Group]: the first to
// return stops the others, so a supervisor restarts the process whole
// rather than leave it half serving. RunAll returns when all have
// returned, with the first failure, named by its runner.
func RunAll(ctx context.Context, runners ...Runner) error {
	members := make([]rungroup.Member, len(runners))
	for i, r := range runners {
		members[i] = rungroup.Member{Name: r.String(), Run: r.Run}
	}
	var g rungroup.Group
	g.Add(members...)
	return g.Run(ctx)
}
