package agent_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
)

// fakeRunner serves until its context ends, or fails at once with err.
type fakeRunner struct {
	name    string
	err     error
	stopped chan struct{}
}

func newFakeRunner(name string, err error) *fakeRunner {
	return &fakeRunner{name: name, err: err, stopped: make(chan struct{})}
}

func (f *fakeRunner) String() string { return f.name }

func (f *fakeRunner) Run(ctx context.Context) error {
	defer close(f.stopped)
	if f.err != nil {
		return f.err
	}
	<-ctx.Done()
	return nil
}

func TestRunAllServesUntilTheContextEnds(t *testing.T) {
	a, b := newFakeRunner("a", nil), newFakeRunner("b", nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- agent.RunAll(ctx, a, b) }()
	select {
	case err := <-done:
		t.Fatalf("RunAll returned %v before its context ended", err)
	case <-time.After(50 * time.Millisecond):
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("RunAll = %v, want nil after the context ended", err)
	}
}

func TestRunAllStopsEveryRunnerWhenOneFails(t *testing.T) {
	boom := errors.New("boom")
	ok1, bad, ok2 := newFakeRunner("agent e.t1", nil), newFakeRunner("agent e.t2", boom), newFakeRunner("agent e.t3", nil)
	err := agent.RunAll(context.Background(), ok1, bad, ok2)
	if !errors.Is(err, boom) {
		t.Fatalf("RunAll = %v, want it to wrap %v", err, boom)
	}
	if want := "agent e.t2: boom"; err.Error() != want {
		t.Errorf("RunAll error = %q, want %q", err, want)
	}
	for _, r := range []*fakeRunner{ok1, bad, ok2} {
		select {
		case <-r.stopped:
		default:
			t.Errorf("runner %s still running after RunAll returned", r)
		}
	}
}
