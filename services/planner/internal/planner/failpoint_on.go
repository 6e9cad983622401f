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
	decisions atomic.Int64 // fenced appends so far
}

// beforeFencedAppend runs in appendDecision after the lease check and right
// before the fenced append. The environment variable
// PF_FAILPOINT_STOP_BEFORE_DECISION=n makes the process stop itself with
// SIGSTOP before its n-th decision: the pause, between the check and the
// publish, that only the storage-side fence can stop.
func (f *failpoints) beforeFencedAppend(log *slog.Logger) {
	n, err := strconv.ParseInt(os.Getenv("PF_FAILPOINT_STOP_BEFORE_DECISION"), 10, 64)
	if err != nil || n <= 0 {
		return
	}
	if f.decisions.Add(1) == n {
		log.Info("failpoint: stopping before a decision", "decision", n)
		// Directed at this thread, the stop takes effect before the
		// syscall returns; sent to the process, another thread could
		// take it while this one went on to publish.
		runtime.LockOSThread()
		_ = syscall.Tgkill(os.Getpid(), syscall.Gettid(), syscall.SIGSTOP)
		runtime.UnlockOSThread()
	}
}
