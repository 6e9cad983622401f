//go:build failpoint

package planner

import (
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
)

// failpoints are test failpoints, compiled in only with -tags failpoint.
type failpoints struct {
	decisions atomic.Int64 // decisions so far
}

// beforeDecision runs in flight.decide after the lease check, before a
// decision joins the round's batch. The environment variable
// PF_FAILPOINT_STOP_BEFORE_DECISION=n makes the process send the batch of
// the decisions before its n-th (send) and then stop itself with SIGSTOP:
// the pause, between the check and the publish of the n-th decision, that
// only the storage-side fence can stop.
func (f *failpoints) beforeDecision(log *slog.Logger, send func()) {
	n, err := strconv.ParseInt(os.Getenv("PF_FAILPOINT_STOP_BEFORE_DECISION"), 10, 64)
	if err != nil || n <= 0 {
		return
	}
	if f.decisions.Add(1) == n {
		send()
		log.Info("failpoint: stopping before a decision", "decision", n)
		// Directed at this thread, the stop takes effect before the
		// syscall returns; sent to the process, another thread could
		// take it while this one went on to publish.
		runtime.LockOSThread()
		_ = syscall.Tgkill(os.Getpid(), syscall.Gettid(), syscall.SIGSTOP)
		runtime.UnlockOSThread()
	}
}
