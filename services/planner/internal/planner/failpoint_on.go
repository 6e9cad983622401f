//go:build failpoint

package planner

import (
	"os"
	"runtime"
	"strconv"
	"syscall"
)

// beforeFencedAppend runs in appendDecision after the lease check and right
// before the fenced append. Built with -tags failpoint (tests only), the
// environment variable PF_FAILPOINT_STOP_BEFORE_DECISION=n makes the process
// stop itself with SIGSTOP before its n-th decision: the pause, between the
// check and the publish, that only the storage-side fence can stop.
func (p *Planner) beforeFencedAppend() {
	n, err := strconv.ParseInt(os.Getenv("PF_FAILPOINT_STOP_BEFORE_DECISION"), 10, 64)
	if err != nil || n <= 0 {
		return
	}
	if p.decisions.Add(1) == n {
		p.log.Info("failpoint: stopping before a decision", "decision", n)
		// Directed at this thread, the stop takes effect before the
		// syscall returns; sent to the process, another thread could
		// take it while this one went on to publish.
		runtime.LockOSThread()
		_ = syscall.Tgkill(os.Getpid(), syscall.Gettid(), syscall.SIGSTOP)
		runtime.UnlockOSThread()
	}
}
