package probe

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

func popAll(t *testing.T, s *scheduler, now time.Time) []ticket {
	t.Helper()
	var out []ticket
	for {
		tk, ok := s.pop(now)
		if !ok {
			return out
		}
		out = append(out, tk)
	}
}

func ids(ts []ticket) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = t.id
	}
	return out
}

// Under overload the probe due earliest goes first, whatever the order the
// proxies joined in, and a proxy that just finished queues behind the ones
// already waiting.
func TestSchedulerServesOldestDueFirst(t *testing.T) {
	s := newScheduler(time.Second, 2)
	for _, p := range []struct {
		id  string
		due time.Duration
	}{{"e", 5}, {"a", 1}, {"c", 3}, {"b", 2}, {"d", 4}, {"later", 60}} {
		s.add(p.id, t0.Add(p.due*time.Second))
	}
	now := t0.Add(10 * time.Second)
	got := popAll(t, s, now)
	if !slices.Equal(ids(got), []string{"a", "b"}) {
		t.Fatalf("first two slots: got %v, want [a b]", ids(got))
	}
	if got[0].late != 9*time.Second || !got[0].due.Equal(t0.Add(time.Second)) {
		t.Fatalf("ticket of a: got due %v late %v, want due t0+1s late 9s", got[0].due, got[0].late)
	}
	// a finishes and is due again at once: c, d and e waited longer.
	s.done(got[0], now, time.Millisecond)
	var order []string
	for _, tk := range got[1:] {
		s.done(tk, now, time.Millisecond)
	}
	for range 5 {
		next := popAll(t, s, now)
		if len(next) == 0 {
			break
		}
		for _, tk := range next {
			order = append(order, tk.id)
			s.done(tk, now, time.Millisecond)
		}
	}
	// Each round serves the two slots freed: c and d, then e and a, then b
	// and c again, each done at now queueing behind the others.
	if want := []string{"c", "d", "e", "a", "b", "c", "d", "e", "a", "b"}; !slices.Equal(order, want) {
		t.Fatalf("dispatch order: got %v, want %v", order, want)
	}
	if slices.Contains(order, "later") {
		t.Fatal("a proxy not yet due was dispatched")
	}
}

// Permanent overload: 50 proxies always due, one slot. Each proxy is probed
// once in every 50 dispatches, none twice before all others had a turn.
func TestSchedulerStarvesNoProxy(t *testing.T) {
	const n = 50
	s := newScheduler(time.Millisecond, 1)
	for i := range n {
		s.add(fmt.Sprintf("p%02d", i), t0.Add(time.Duration(i)*time.Microsecond))
	}
	last := map[string]int{}
	now := t0
	for i := range 20 * n {
		now = now.Add(time.Second) // each probe takes far longer than the interval
		tk, ok := s.pop(now)
		if !ok {
			t.Fatalf("dispatch %d: nothing due under overload", i)
		}
		if prev, seen := last[tk.id]; seen && i-prev != n {
			t.Fatalf("%s probed at dispatch %d and %d: want exactly %d dispatches apart", tk.id, prev, i, n)
		}
		last[tk.id] = i
		if _, ok := s.pop(now); ok {
			t.Fatal("two probes in flight with one slot")
		}
		s.done(tk, now.Add(time.Millisecond), time.Second)
	}
	if len(last) != n {
		t.Fatalf("%d of %d proxies probed", len(last), n)
	}
}

// A new proxy's first probe goes before the re-probes due earlier, so a
// burst of new proxies gets ready at the pace of the probes; a re-probe
// that fell due more than an interval before a first probe goes first all
// the same, and a proxy removed and added back is new again.
func TestSchedulerProbesNewProxiesFirst(t *testing.T) {
	const interval = 5 * time.Second
	s := newScheduler(interval, 1)
	for _, id := range []string{"ready-1", "ready-2"} {
		s.add(id, t0)
		tk, ok := s.pop(t0)
		if !ok {
			t.Fatalf("first probe of %s not dispatched", id)
		}
		s.done(tk, t0.Add(time.Second), time.Millisecond) // re-probe due at t0+1s
	}
	s.add("new-1", t0.Add(2*time.Second))
	s.add("new-2", t0.Add(3*time.Second))
	s.remove("ready-2")
	s.add("ready-2", t0.Add(4*time.Second)) // back as a new proxy

	var order []string
	now := t0.Add(4 * time.Second)
	for range 4 {
		tk, ok := s.pop(now)
		if !ok {
			t.Fatalf("nothing dispatched at %v after %v", now.Sub(t0), order)
		}
		order = append(order, tk.id)
		s.done(tk, now.Add(time.Hour), time.Millisecond)
	}
	if want := []string{"new-1", "new-2", "ready-2", "ready-1"}; !slices.Equal(order, want) {
		t.Fatalf("dispatch order: got %v, want %v (first probes before re-probes)", order, want)
	}

	// A re-probe due more than an interval before a first probe goes
	// first; one due less than an interval before it waits.
	for _, c := range []struct {
		newDue time.Duration
		want   string
	}{{interval + 2*time.Second, "ready"}, {interval, "new"}} {
		s = newScheduler(interval, 1)
		s.add("ready", t0)
		tk, _ := s.pop(t0)
		s.done(tk, t0.Add(time.Second), time.Millisecond) // due at t0+1s
		s.add("new", t0.Add(c.newDue))
		now := t0.Add(c.newDue)
		if tk, ok := s.pop(now); !ok || tk.id != c.want {
			t.Fatalf("re-probe due at t0+1s, first probe at t0+%v: dispatched %q (%v), want %s", c.newDue, tk.id, ok, c.want)
		}
	}
}

func TestSchedulerAddRemove(t *testing.T) {
	s := newScheduler(time.Second, 4)
	s.add("a", t0)
	s.add("b", t0)
	if s.add("a", t0.Add(-time.Hour)) {
		t.Fatal("adding a scheduled proxy again: want false")
	}
	s.remove("b") // waiting
	s.remove("nope")
	got := popAll(t, s, t0)
	if !slices.Equal(ids(got), []string{"a"}) {
		t.Fatalf("after removing b: got %v, want [a]", ids(got))
	}

	// Removed while in flight: not scheduled again.
	s.remove("a")
	if s.live != 0 {
		t.Fatalf("%d proxies scheduled after removing the last", s.live)
	}
	s.done(got[0], t0, time.Millisecond)
	if got := popAll(t, s, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("removed proxies dispatched: %v", ids(got))
	}
	if s.live != 0 || len(s.entries) != 0 {
		t.Fatalf("entries left after every proxy was removed: %v", s.entries)
	}

	// Removed and added back while in flight: still one probe in flight,
	// then scheduled at the due time the new add gave it.
	s.add("c", t0)
	first := popAll(t, s, t0)
	s.remove("c")
	if !s.add("c", t0.Add(time.Second)) {
		t.Fatal("adding back a removed proxy: want true")
	}
	if got := popAll(t, s, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("c dispatched twice at once: %v", ids(got))
	}
	s.done(first[0], t0.Add(time.Hour), time.Millisecond)
	got = popAll(t, s, t0.Add(time.Second))
	if !slices.Equal(ids(got), []string{"c"}) || !got[0].due.Equal(t0.Add(time.Second)) {
		t.Fatalf("c added back: got %v, want c due at t0+1s", got)
	}
}

// startRecorder runs s in the bubble and returns the tickets it starts.
func startRecorder(t *testing.T, s *scheduler) (started chan ticket, stop func()) {
	t.Helper()
	return startRecorderBehind(t, s, nil)
}

// startRecorderBehind is startRecorder with run's behind.
func startRecorderBehind(t *testing.T, s *scheduler, behind func() bool) (started chan ticket, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	started = make(chan ticket, 2*maxConcurrency)
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.run(ctx, behind, func(tk ticket) { started <- tk })
	}()
	return started, func() { cancel(); <-done }
}

// While the views are behind the log, at most minConcurrency probes are in
// flight whatever the configured concurrency; once they caught up, the
// next probe that ends frees the configured slots again.
func TestSchedulerHoldsBackWhileBehind(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const fleet = 100
		start := time.Now()
		s := newScheduler(time.Minute, fleet)
		for i := range fleet {
			s.add(fmt.Sprintf("p%03d", i), start)
		}
		var behind atomic.Bool
		behind.Store(true)
		started, stop := startRecorderBehind(t, s, behind.Load)
		defer stop()
		synctest.Wait()
		if got := len(started); got != minConcurrency {
			t.Fatalf("behind: %d probes started, want %d", got, minConcurrency)
		}
		behind.Store(false)
		s.done(<-started, time.Now().Add(time.Minute), time.Millisecond)
		synctest.Wait()
		// minConcurrency-1 still in flight, and every other proxy started.
		if got, want := len(started), fleet-minConcurrency+minConcurrency-1; got != want {
			t.Fatalf("caught up: %d probes waiting to be seen, want %d", got, want)
		}
	})
}

func recv(t *testing.T, ch chan ticket) ticket {
	t.Helper()
	synctest.Wait()
	select {
	case tk := <-ch:
		return tk
	default:
		t.Fatal("no probe started")
		return ticket{}
	}
}

func none(t *testing.T, ch chan ticket) {
	t.Helper()
	synctest.Wait()
	select {
	case tk := <-ch:
		t.Fatalf("%s started, want none", tk.id)
	default:
	}
}

// A freed slot starts the next due probe at once: the clock of the bubble
// only moves when every goroutine waits on it, so a dispatcher waiting for a
// tick would start b later than t.
func TestSchedulerDispatchesWhenASlotFrees(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		s := newScheduler(time.Minute, 1)
		s.add("a", start)
		s.add("b", start)
		started, stop := startRecorder(t, s)
		defer stop()

		a := recv(t, started)
		none(t, started)
		time.Sleep(3 * time.Second) // a's probe takes 3s
		s.done(a, time.Now().Add(time.Minute), 3*time.Second)
		b := recv(t, started)
		if b.id != "b" || b.late != 3*time.Second {
			t.Fatalf("after a: got %s late %v, want b late 3s", b.id, b.late)
		}
		if d := time.Since(start); d != 3*time.Second {
			t.Fatalf("b started %v after the start, want exactly 3s (when a's slot freed)", d)
		}
	})
}

// A probe starts exactly at its due time, not at the next tick.
func TestSchedulerStartsOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		s := newScheduler(time.Minute, 4)
		s.add("a", start.Add(1234*time.Millisecond))
		started, stop := startRecorder(t, s)
		defer stop()
		none(t, started)
		// A proxy joining while run waits is due before the timer it set.
		s.add("b", start.Add(700*time.Millisecond))

		time.Sleep(2 * time.Second)
		b, a := recv(t, started), recv(t, started)
		if b.id != "b" || a.id != "a" || b.late != 0 || a.late != 0 {
			t.Fatalf("got %s late %v then %s late %v; want b then a, both on time", b.id, b.late, a.id, a.late)
		}
	})
}

// Proxies added and removed while the scheduler runs: a removed proxy is
// not probed again, an added one is probed at its due time.
func TestSchedulerAddRemoveWhileRunning(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		s := newScheduler(time.Minute, 2)
		for _, id := range []string{"a", "b", "c"} {
			s.add(id, start)
		}
		started, stop := startRecorder(t, s)
		defer stop()
		a, b := recv(t, started), recv(t, started)
		if a.id != "a" || b.id != "b" {
			t.Fatalf("first two: %s %s, want a b", a.id, b.id)
		}
		s.remove("c") // waiting for a slot
		s.remove("a") // in flight
		s.done(a, time.Now().Add(time.Second), time.Second)
		none(t, started)

		s.add("d", time.Now().Add(5*time.Second))
		time.Sleep(5 * time.Second)
		if d := recv(t, started); d.id != "d" || d.late != 0 {
			t.Fatalf("added proxy: got %s late %v, want d on time", d.id, d.late)
		}
		s.done(b, time.Now().Add(time.Second), time.Second)
		time.Sleep(time.Hour)
		// b comes back once its probe is done; a and c never do.
		if got := recv(t, started); got.id != "b" {
			t.Fatalf("got %s, want b", got.id)
		}
		none(t, started)
	})
}

func TestConcurrencyFor(t *testing.T) {
	for _, tc := range []struct {
		n              int
		mean, interval time.Duration
		want           int
	}{
		{0, time.Second, 5 * time.Second, minConcurrency},
		{10_000, 0, 15 * time.Second, minConcurrency}, // nothing measured yet
		{10_000, 2 * time.Millisecond, 15 * time.Second, minConcurrency},
		{10_000, 500 * time.Millisecond, 15 * time.Second, 646},     // 2×10000×0.5/15.5
		{10_000, 500 * time.Millisecond, 5 * time.Second, 1024},     // 1819, bounded
		{1_000, 250 * time.Millisecond, 5 * time.Second, 96},        // 2×1000×0.25/5.25 = 95.2
		{100_000, 6 * time.Second, 5 * time.Second, 1024},           // dead fleet
		{100, 6 * time.Second, 5 * time.Second, 110},                // 2×100×6/11 = 109.1
		{50, 5 * time.Millisecond, 2 * time.Millisecond, 72},        // interval shorter than a probe: 71.4
		{5_000, 100 * time.Millisecond, 2 * time.Second, 477},       // 2×5000×0.1/2.1 = 476.2
		{1, time.Hour, time.Second, 32},                             // one proxy, one slot would do
		{3_000, 30 * time.Millisecond, 300 * time.Millisecond, 546}, // 2×3000×0.03/0.33 = 545.5
	} {
		if got := concurrencyFor(tc.n, tc.mean, tc.interval); got != tc.want {
			t.Errorf("concurrencyFor(%d, %v, %v) = %d, want %d", tc.n, tc.mean, tc.interval, got, tc.want)
		}
	}
}

// The scheduler follows the fleet's size and the probes' mean duration.
func TestSchedulerSizesForTheFleet(t *testing.T) {
	s := newScheduler(time.Second, 0)
	for i := range 1000 {
		s.add(fmt.Sprintf("p%d", i), t0)
	}
	if s.limit != minConcurrency {
		t.Fatalf("before any probe: limit %d, want %d", s.limit, minConcurrency)
	}
	got := popAll(t, s, t0)
	if len(got) != minConcurrency {
		t.Fatalf("dispatched %d, want %d", len(got), minConcurrency)
	}
	for _, tk := range got {
		s.done(tk, t0.Add(time.Second), time.Second)
	}
	// 1000 proxies, probes of 1s every 1s: 500 in flight on average.
	if want := concurrencyFor(1000, time.Second, time.Second); s.limit != want || want != 1000 {
		t.Fatalf("after probes of 1s: limit %d, want %d (1000)", s.limit, want)
	}
	if got := popAll(t, s, t0); len(got) != 1000-minConcurrency {
		t.Fatalf("dispatched %d more, want the %d still due", len(got), 1000-minConcurrency)
	}

	fixed := newScheduler(time.Second, 3)
	for i := range 10 {
		fixed.add(fmt.Sprintf("p%d", i), t0)
	}
	if got := popAll(t, fixed, t0); len(got) != 3 {
		t.Fatalf("configured concurrency 3: dispatched %d", len(got))
	}
}

// expedite makes a waiting proxy due now, ahead of the others due later;
// a proxy in flight or unknown is left alone.
func TestSchedulerExpedite(t *testing.T) {
	s := newScheduler(time.Hour, 4)
	s.add("a", t0.Add(time.Hour))
	s.add("b", t0.Add(2*time.Hour))
	if got := popAll(t, s, t0); len(got) != 0 {
		t.Fatalf("due before their time: %v", ids(got))
	}
	if !s.expedite("b", t0) {
		t.Fatal("expedite of a waiting proxy: false")
	}
	got := popAll(t, s, t0)
	if !slices.Equal(ids(got), []string{"b"}) {
		t.Fatalf("after expedite(b): %v, want [b]", ids(got))
	}
	if s.expedite("b", t0) {
		t.Fatal("expedite of a proxy in flight: true")
	}
	if s.expedite("nobody", t0) {
		t.Fatal("expedite of an unknown proxy: true")
	}
	s.remove("a")
	if s.expedite("a", t0) {
		t.Fatal("expedite of a removed proxy: true")
	}
	s.done(got[0], t0.Add(time.Hour), time.Millisecond)
	if !s.expedite("b", t0.Add(time.Second)) {
		t.Fatal("expedite after its probe ended: false")
	}
	if got := popAll(t, s, t0.Add(time.Second)); !slices.Equal(ids(got), []string{"b"}) {
		t.Fatalf("second expedite: %v", ids(got))
	}
}
