package testwait_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/testwait"
)

func TestForReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	start := time.Now()
	err := testwait.For(context.Background(), func() bool { return calls.Add(1) >= 5 })
	if err != nil {
		t.Fatalf("For = %v, want nil", err)
	}
	if n := calls.Load(); n != 5 {
		t.Errorf("cond called %d times, want 5 (no call after it held)", n)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %s for 5 polls", d)
	}
}

func TestForChecksAtOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := testwait.For(ctx, func() bool { return true }); err != nil {
		t.Fatalf("For with a true condition and an ended context = %v, want nil", err)
	}
}

func TestForEndsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := testwait.For(ctx, func() bool { return false }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("For = %v, want the context's deadline", err)
	}
}

func TestContextEndsWithinOrWithTheTest(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Millisecond)
	<-ctx.Done()
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("ctx.Err() = %v, want the deadline", ctx.Err())
	}
	var inner context.Context
	t.Run("inner", func(t *testing.T) {
		inner = testwait.Context(t, time.Hour)
		if inner.Err() != nil {
			t.Fatalf("a fresh test context ended: %v", inner.Err())
		}
	})
	if !errors.Is(inner.Err(), context.Canceled) {
		t.Fatalf("after its test: ctx.Err() = %v, want canceled", inner.Err())
	}
}

func TestStop(t *testing.T) {
	// A process that exits on the signal is waited for.
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	testwait.Stop(cmd, syscall.SIGTERM, time.Minute)
	if cmd.ProcessState == nil || time.Since(start) > 30*time.Second {
		t.Fatalf("Stop returned after %s with state %v, want sleep waited for at once", time.Since(start), cmd.ProcessState)
	}
	// One that ignores it is killed after the grace.
	cmd = exec.Command("sh", "-c", "trap '' TERM; echo trapped; exec sleep 60")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := out.Read(make([]byte, 8)); err != nil { // the trap is set
		t.Fatal(err)
	}
	start = time.Now()
	testwait.Stop(cmd, syscall.SIGTERM, 200*time.Millisecond)
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("state %v after Stop, want killed", cmd.ProcessState)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Fatalf("killed after %s, want the grace of 200ms first", d)
	}
}

// recorder is a testing.TB that records a failure instead of stopping.
type recorder struct {
	testing.TB
	failed string
}

func (r *recorder) Helper()                           {}
func (r *recorder) Fatalf(format string, args ...any) { r.failed = fmt.Sprintf(format, args...) }

func TestUntil(t *testing.T) {
	var n atomic.Int32
	time.AfterFunc(20*time.Millisecond, func() { n.Store(1) })
	testwait.Until(t, 5*time.Second, "the flag", func() bool { return n.Load() == 1 })

	r := &recorder{TB: t}
	start := time.Now()
	testwait.Until(r, 50*time.Millisecond, "nothing", func() bool { return false })
	if want := "timed out after 50ms waiting for nothing"; r.failed != want {
		t.Errorf("Until of a condition that never holds failed with %q, want %q", r.failed, want)
	}
	if d := time.Since(start); d < 50*time.Millisecond || d > 2*time.Second {
		t.Errorf("Until failed after %s, want about 50ms", d)
	}
}

func TestBuffer(t *testing.T) {
	var b testwait.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 100 {
			_, _ = b.Write([]byte("x"))
		}
	}()
	testwait.Until(t, 5*time.Second, "100 writes", func() bool { return len(b.String()) == 100 })
	<-done
}
