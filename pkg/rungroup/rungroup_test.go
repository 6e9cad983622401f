package rungroup_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"proxyfleet/pkg/rungroup"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	errBoom = errors.New("boom")
	errLate = errors.New("late")
)

// How a fake member behaves.
type behaviour int

const (
	serves         behaviour = iota // returns nil when its context ends
	fails                           // returns boom at once
	failsLater                      // returns boom after 20ms
	failsOnStop                     // returns late when its context ends
	returns                         // returns nil at once
	canceledOnStop                  // returns its context's error when it ends
	ignoresCtx                      // returns only when the test ends
)

// journal records the order in which members returned.
type journal struct {
	mu  sync.Mutex
	out []string
}

func (j *journal) add(name string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.out = append(j.out, name)
}

func (j *journal) got() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.out)
}

func fake(name string, b behaviour, j *journal, release <-chan struct{}) rungroup.Member {
	return rungroup.Member{Name: name, Run: func(ctx context.Context) error {
		defer j.add(name)
		switch b {
		case fails:
			return errBoom
		case failsLater:
			time.Sleep(20 * time.Millisecond)
			return errBoom
		case returns:
			return nil
		case ignoresCtx:
			<-release
			return nil
		}
		<-ctx.Done()
		switch b {
		case failsOnStop:
			return errLate
		case canceledOnStop:
			return fmt.Errorf("start: %w", ctx.Err())
		}
		return nil
	}}
}

func TestGroup(t *testing.T) {
	type member struct {
		name string
		b    behaviour
	}
	for _, tc := range []struct {
		name string
		// stages are the members of each Add.
		stages [][]member
		// cancel ends Run's context after 20ms.
		cancel bool
		// wantErr is Run's error text, "" for nil; wantIs what it wraps.
		wantErr string
		wantIs  error
		// order is the order the members return; members of one stage
		// may return in any order and are listed sorted.
		order [][]string
	}{
		{
			name:   "the context ends: a clean stop, the last added first",
			stages: [][]member{{{"loop", serves}}, {{"probe", serves}, {"targets", serves}}, {{"api", serves}}},
			cancel: true,
			order:  [][]string{{"api"}, {"probe", "targets"}, {"loop"}},
		},
		{
			name:    "the first error wins, the others are stopped in order",
			stages:  [][]member{{{"loop", serves}}, {{"bad", failsLater}, {"probe", failsOnStop}}, {{"api", failsOnStop}}},
			wantErr: "bad: boom", wantIs: errBoom,
			order: [][]string{{"bad"}, {"api"}, {"probe"}, {"loop"}},
		},
		{
			name:    "an error while stopping is the result of a stop without one",
			stages:  [][]member{{{"loop", failsOnStop}}, {{"api", serves}}},
			cancel:  true,
			wantErr: "loop: late", wantIs: errLate,
			order: [][]string{{"api"}, {"loop"}},
		},
		{
			name:   "a member returning nil stops the group",
			stages: [][]member{{{"loop", serves}}, {{"once", returns}}, {{"api", serves}}},
			order:  [][]string{{"once"}, {"api"}, {"loop"}},
		},
		{
			name:    "one failing agent runtime stops its siblings",
			stages:  [][]member{{{"agent e.t1", serves}, {"agent e.t2", fails}, {"agent e.t3", serves}}},
			wantErr: "agent e.t2: boom", wantIs: errBoom,
			order: [][]string{{"agent e.t2"}, {"agent e.t1", "agent e.t3"}},
		},
		{
			name:   "a cancelled start-up is a clean stop",
			stages: [][]member{{{"planner", canceledOnStop}}},
			cancel: true,
			order:  [][]string{{"planner"}},
		},
		{
			name:    "a member that ignores its context is reported, and the rest still stop",
			stages:  [][]member{{{"loop", serves}}, {{"stuck", ignoresCtx}}, {{"api", serves}}},
			cancel:  true,
			wantErr: "stuck: did not stop within 100ms", wantIs: rungroup.ErrStopTimeout,
			order: [][]string{{"api"}, {"loop"}, {"stuck"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := &journal{}
			release := make(chan struct{})
			g := rungroup.Group{StopTimeout: 100 * time.Millisecond}
			for _, s := range tc.stages {
				var ms []rungroup.Member
				for _, m := range s {
					ms = append(ms, fake(m.name, m.b, j, release))
				}
				g.Add(ms...)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancel {
				time.AfterFunc(20*time.Millisecond, cancel)
			}
			err := g.Run(ctx)
			close(release)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || err.Error() != tc.wantErr) {
				t.Errorf("Run = %v, want %q", err, tc.wantErr)
			}
			if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
				t.Errorf("Run = %v, want it to wrap %v", err, tc.wantIs)
			}
			var want []string
			for _, s := range tc.order {
				want = append(want, s...)
			}
			got := waitReturns(t, j, len(want))
			// Sort within each stage of the wanted order.
			i := 0
			for _, s := range tc.order {
				slices.Sort(got[i : i+len(s)])
				i += len(s)
			}
			if !slices.Equal(got, want) {
				t.Errorf("members returned in the order %v, want %v", got, want)
			}
		})
	}
}

// waitReturns waits until n members have returned (a member left behind
// returns once released) and returns their order.
func waitReturns(t *testing.T, j *journal, n int) []string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(j.got()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("returned: %v, want %d members", j.got(), n)
		}
		time.Sleep(time.Millisecond)
	}
	return j.got()
}

// TestStageStopsWhileEarlierOnesServe: a member being stopped still has
// the members added before it (what it depends on) serving.
func TestStageStopsWhileEarlierOnesServe(t *testing.T) {
	var g rungroup.Group
	var loopCtx context.Context
	started := make(chan struct{})
	g.Go("loop", func(ctx context.Context) error {
		loopCtx = ctx
		close(started)
		<-ctx.Done()
		return nil
	})
	var loopAlive bool
	g.Go("api", func(ctx context.Context) error {
		<-started
		<-ctx.Done()
		loopAlive = loopCtx.Err() == nil
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	if err := g.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if !loopAlive {
		t.Error("the loop was stopped before the api returned; want the api stopped first")
	}
}

func TestSignalStops(t *testing.T) {
	ctx, stop := rungroup.SignalContext()
	defer stop()
	var g rungroup.Group
	g.Go("loop", func(ctx context.Context) error { <-ctx.Done(); return nil })
	time.AfterFunc(10*time.Millisecond, func() { _ = syscall.Kill(os.Getpid(), syscall.SIGTERM) })
	if err := g.Run(ctx); err != nil {
		t.Fatalf("Run after SIGTERM = %v, want nil", err)
	}
	if cause := context.Cause(ctx); cause == nil || !strings.Contains(cause.Error(), "terminated") {
		t.Errorf("cause %v, want one naming the signal", cause)
	}
}
