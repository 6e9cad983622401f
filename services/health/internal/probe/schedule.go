package probe

import (
	"container/heap"
	"context"
	"math"
	"sync"
	"time"
)

// Bounds of the concurrency the scheduler sizes for the fleet when none is
// configured.
const (
	minConcurrency = 32
	maxConcurrency = 1024
)

// scheduler hands out the proxies to probe in the order their probes fall
// due, oldest due first, as soon as one is due and a slot is free. A proxy
// is handed out again only after its probe is [scheduler.done], so each proxy
// has at most one probe in flight and the waiting ones are served before a
// proxy that just finished (its next due time lies ahead of theirs): under
// overload every proxy is probed in turn and none starves.
//
// A proxy's first probe is served as if it fell due one interval earlier
// than it did: it is what turns a new proxy ready, while a re-probe only
// confirms what is known. So a burst of new proxies (a pool filled, a
// fleet replaced) gets ready at the pace the probes allow, not behind the
// fleet's re-probes, and neither kind starves the other: a re-probe waits
// for first probes by one interval at most.
//
// All methods are safe for concurrent use; [scheduler.run] is the one
// dispatching goroutine. The scheduler calls nothing outside itself with its
// lock held.
type scheduler struct {
	interval time.Duration
	fixed    int // configured concurrency; 0 sizes it for the fleet

	wake chan struct{} // capacity 1: something may be dispatchable now

	mu       sync.Mutex
	fresh    dueQueue          // proxies waiting for their first probe, earliest due first
	queue    dueQueue          // proxies waiting for a re-probe, earliest due first
	entries  map[string]*entry // every scheduled proxy, waiting or in flight
	live     int               // entries not removed
	inflight int
	limit    int
	mean     time.Duration // moving average of probe durations
	seq      uint64
}

// entry is one scheduled proxy. Its fields are guarded by scheduler.mu.
type entry struct {
	id    string
	due   time.Time
	seq   uint64 // breaks ties of due: scheduled first, served first
	index int    // position in its queue; -1 while its probe is in flight
	// first: the proxy waits for its first probe, in the fresh queue.
	first bool
	// removed marks a proxy removed while its probe was in flight: the
	// entry stays until [scheduler.done], so a proxy added back meanwhile
	// still has one probe in flight at most.
	removed bool
	// readded marks a removed proxy added back while its probe was in
	// flight: done schedules it at due, as a new proxy.
	readded bool
}

// ticket is one dispatched probe: the proxy, when it was due and how late
// it started. Hand it back to [scheduler.done].
type ticket struct {
	id   string
	due  time.Time
	late time.Duration
	e    *entry
}

// newScheduler returns a scheduler for proxies probed every interval, with
// at most concurrency probes in flight, or as many as the fleet needs when
// concurrency is 0 (see [concurrencyFor]).
func newScheduler(interval time.Duration, concurrency int) *scheduler {
	s := &scheduler{
		interval: interval,
		fixed:    concurrency,
		wake:     make(chan struct{}, 1),
		entries:  map[string]*entry{},
	}
	s.resizeLocked()
	return s
}

// add schedules id's first probe at due. A proxy already scheduled keeps
// its schedule; add then reports false.
func (s *scheduler) add(id string, due time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.entries[id]; e != nil {
		if !e.removed {
			return false
		}
		e.removed, e.readded, e.due = false, true, due
		s.live++
		s.resizeLocked()
		return true
	}
	e := &entry{id: id, due: due, seq: s.nextSeq(), first: true}
	s.entries[id] = e
	s.live++
	heap.Push(&s.fresh, e)
	s.resizeLocked()
	s.signal()
	return true
}

// remove stops scheduling id. A probe of id in flight finishes, but
// [scheduler.done] does not schedule it again.
func (s *scheduler) remove(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.entries[id]
	if e == nil || e.removed {
		return
	}
	s.live--
	if e.index >= 0 {
		heap.Remove(s.queueOf(e), e.index)
		delete(s.entries, id)
	} else {
		e.removed, e.readded = true, false
	}
	s.resizeLocked()
}

// expedite makes id due at now if it waits for a later probe, and reports
// whether it did: a proxy whose probe is in flight, or that is due
// already, is left as it is.
func (s *scheduler) expedite(id string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.entries[id]
	if e == nil || e.removed || e.index < 0 || !e.due.After(now) {
		return false
	}
	e.due = now
	heap.Fix(s.queueOf(e), e.index)
	s.signal()
	return true
}

// pop takes the next proxy to probe (see [scheduler]), if one is due at now
// and a slot is free.
func (s *scheduler) pop(now time.Time) (ticket, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.popLocked(now, s.limit)
}

// popLocked is pop with the slots bounded by limit.
func (s *scheduler) popLocked(now time.Time, limit int) (ticket, bool) {
	if s.inflight >= limit {
		return ticket{}, false
	}
	freshDue := len(s.fresh) > 0 && !s.fresh[0].due.After(now)
	reDue := len(s.queue) > 0 && !s.queue[0].due.After(now)
	var q *dueQueue
	switch {
	case reDue && (!freshDue || s.queue[0].due.Add(s.interval).Before(s.fresh[0].due)):
		q = &s.queue
	case freshDue:
		q = &s.fresh
	default:
		return ticket{}, false
	}
	e := heap.Pop(q).(*entry)
	s.inflight++
	return ticket{id: e.id, due: e.due, late: now.Sub(e.due), e: e}, true
}

// queueOf returns the queue e waits in.
func (s *scheduler) queueOf(e *entry) *dueQueue {
	if e.first {
		return &s.fresh
	}
	return &s.queue
}

// earliestLocked returns the earliest due time of the waiting proxies.
func (s *scheduler) earliestLocked() (time.Time, bool) {
	switch {
	case len(s.fresh) == 0 && len(s.queue) == 0:
		return time.Time{}, false
	case len(s.fresh) == 0:
		return s.queue[0].due, true
	case len(s.queue) == 0 || s.fresh[0].due.Before(s.queue[0].due):
		return s.fresh[0].due, true
	}
	return s.queue[0].due, true
}

// done frees t's slot and, unless its proxy was removed meanwhile,
// schedules the proxy's next probe at next (or, for a proxy removed and
// added back meanwhile, at the due time add gave it). took is how long the
// probe held the slot (0 when it did not run); it sizes the concurrency.
func (s *scheduler) done(t ticket, next time.Time, took time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inflight--
	switch {
	case took <= 0:
	case s.mean == 0:
		s.mean = took
	default:
		s.mean += (took - s.mean) / 32
	}
	e := t.e
	switch {
	case e.removed:
		delete(s.entries, e.id)
	case e.readded:
		e.readded, e.seq, e.first = false, s.nextSeq(), true
		heap.Push(&s.fresh, e)
	default:
		e.due, e.seq, e.first = next, s.nextSeq(), false
		heap.Push(&s.queue, e)
	}
	s.resizeLocked()
	s.signal()
}

// run hands each proxy to start when it falls due and a slot is free, until
// ctx ends. start runs on run's goroutine and must not block: it launches
// the probe, which ends with [scheduler.done]. While behind (may be nil)
// reports true, at most minConcurrency probes are in flight (see
// Config.Behind); it is asked each time run dispatches.
func (s *scheduler) run(ctx context.Context, behind func() bool, start func(ticket)) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var batch []ticket
	for {
		held := behind != nil && behind()
		s.mu.Lock()
		limit := s.limit
		if held {
			limit = min(limit, minConcurrency)
		}
		now := time.Now()
		for {
			t, ok := s.popLocked(now, limit)
			if !ok {
				break
			}
			batch = append(batch, t)
		}
		wait := time.Duration(-1)
		if due, ok := s.earliestLocked(); ok && s.inflight < limit {
			wait = due.Sub(now)
		}
		s.mu.Unlock()
		for i, t := range batch {
			start(t)
			batch[i] = ticket{}
		}
		batch = batch[:0]
		// Slots freed and proxies added arrive on wake; the timer only
		// covers the earliest due time while a slot is free.
		var due <-chan time.Time
		if wait >= 0 {
			timer.Reset(wait)
			due = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-due:
		}
	}
}

// signal wakes run without blocking.
func (s *scheduler) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *scheduler) nextSeq() uint64 {
	s.seq++
	return s.seq
}

func (s *scheduler) resizeLocked() {
	if s.fixed > 0 {
		s.limit = s.fixed
		return
	}
	s.limit = concurrencyFor(s.live, s.mean, s.interval)
}

// concurrencyFor sizes the probes in flight for n proxies probed every
// interval (counted from the end of the previous probe) when a probe takes
// mean: by Little's law n×mean/(interval+mean) are in flight on average;
// twice that absorbs bursts (a restart probes the whole fleet within a
// quarter interval, new proxies are probed at once) and slow spells. The
// result lies in [minConcurrency, maxConcurrency].
func concurrencyFor(n int, mean, interval time.Duration) int {
	if n <= 0 || mean <= 0 {
		return minConcurrency
	}
	need := 2 * float64(n) * mean.Seconds() / (interval + mean).Seconds()
	return int(min(max(math.Ceil(need), minConcurrency), maxConcurrency))
}

// dueQueue is a min-heap of entries by due time, then by seq.
type dueQueue []*entry

func (q dueQueue) Len() int { return len(q) }

func (q dueQueue) Less(i, j int) bool {
	if !q[i].due.Equal(q[j].due) {
		return q[i].due.Before(q[j].due)
	}
	return q[i].seq < q[j].seq
}

func (q dueQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = i, j
}

func (q *dueQueue) Push(x any) {
	e := x.(*entry)
	e.index = len(*q)
	*q = append(*q, e)
}

func (q *dueQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	old[len(old)-1] = nil
	e.index = -1
	*q = old[:len(old)-1]
	return e
}
