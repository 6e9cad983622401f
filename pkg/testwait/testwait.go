// Package testwait waits, in tests, for what happens asynchronously: a
// condition polled until it holds, within a bound, instead of a sleep, a
// [Context] that bounds a test's calls, and a [Buffer] of a process's
// output to poll, and [Stop], which waits a bounded time for a process the
// test started to exit. bustest.WaitEvent builds on it to wait for a
// proxy's event.
package testwait

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"
)

// Poll intervals: a condition is checked at once, then after firstPoll,
// each wait half again as long up to maxPoll, so a quick change is seen
// at once and a long wait (a VM booting) does not poll a server flat out.
const (
	firstPoll = 5 * time.Millisecond
	maxPoll   = 50 * time.Millisecond
)

// For calls cond until it returns true, and returns nil then, or ctx's
// error when ctx ends first. cond runs on the calling goroutine: it may
// call t.Fatal for a state that can no longer turn out right. For is for
// a test that bounds its waits by a context or says more when one times
// out; [Until] is the common case.
func For(ctx context.Context, cond func() bool) error {
	wait := firstPoll
	for !cond() {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(wait*3/2, maxPoll)
	}
	return nil
}

// Until calls cond until it returns true, and fails t with "timed out
// after <within> waiting for <what>" when it has not within the given
// time.
func Until(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if err := For(ctx, cond); err != nil {
		t.Fatalf("timed out after %s waiting for %s", within, what)
	}
}

// Context bounds a test's calls: it ends after within, or when the test's
// function returns ([testing.T.Context]), whichever comes first. It takes
// the place of a context.WithTimeout and its deferred cancel at the top of
// a test.
func Context(t testing.TB, within time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), within)
	t.Cleanup(cancel)
	return ctx
}

// Stop ends cmd, started and not yet waited for: it sends sig (SIGTERM, for
// a service's graceful stop), waits up to grace for the process to exit,
// kills it if it has not, and returns once cmd has been waited for.
func Stop(cmd *exec.Cmd, sig os.Signal, grace time.Duration) {
	_ = cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-done
	}
}

// Buffer collects what a process or a logger writes, for a test to read
// (and wait on) while the writing goes on: it is safe for concurrent
// writers and readers. The zero value is ready to use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
