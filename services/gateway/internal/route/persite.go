package route

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"proxyfleet/pkg/events"
)

// ErrAtLimit is wrapped by a [*LimitError]: every proxy that could carry
// a request is at its per-site limit.
var ErrAtLimit = errors.New("every usable proxy is at its per-site limit")

// LimitError says that every proxy that could carry a request to Site is
// at its per-site limit ([events.PerSite]) in Pool.
type LimitError struct {
	Pool, Site string
	// Limits are the pool's per-site limits.
	Limits events.PerSite
	// RetryAfter is when a proxy may be under its limits again: the next
	// token of a rate-limited proxy, or 1s when proxies are held by their
	// requests in flight.
	RetryAfter time.Duration

	// wake is closed when a request to Site ends; refill, when non-zero,
	// is when a proxy held only by its rate gets a token.
	wake   <-chan struct{}
	refill time.Duration
}

func (e *LimitError) Error() string {
	var limits []string
	if e.Limits.Concurrency > 0 {
		limits = append(limits, fmt.Sprintf("perSite.concurrency %d", e.Limits.Concurrency))
	}
	if e.Limits.Rate > 0 {
		limits = append(limits, fmt.Sprintf("perSite.rate %g/s", e.Limits.Rate))
	}
	return fmt.Sprintf("pool %q: every usable proxy is at its limit for site %s (%s, per proxy)", e.Pool, e.Site, strings.Join(limits, ", "))
}

// Unwrap makes a LimitError match [ErrAtLimit].
func (e *LimitError) Unwrap() error { return ErrAtLimit }

// sweepEvery is how often a pool drops the state of its idle sites.
const sweepEvery = time.Second

// siteState is what a pool holds of one site: per proxy, its requests in
// flight there and its token bucket.
type siteState struct {
	proxies map[string]*proxySite
	// wake is closed (and forgotten) when a request to the site ends;
	// nil while nobody waits.
	wake chan struct{}
}

type proxySite struct {
	open int
	// tokens is the bucket's content at at.
	tokens float64
	at     time.Time
}

// refill brings x's bucket to now under limits.
func (x *proxySite) refill(limits *events.PerSite, now time.Time) {
	if limits == nil || limits.Rate <= 0 {
		return
	}
	if d := now.Sub(x.at); d > 0 {
		x.tokens = min(float64(limits.Burst()), x.tokens+d.Seconds()*limits.Rate)
		x.at = now
	}
}

// idle reports whether x holds nothing a new proxySite would not: no
// request in flight, a full bucket.
func (x *proxySite) idle(limits *events.PerSite, now time.Time) bool {
	if x.open > 0 {
		return false
	}
	if limits == nil || limits.Rate <= 0 {
		return true
	}
	x.refill(limits, now)
	return x.tokens >= float64(limits.Burst())
}

// limiter checks and takes one pick's per-site limits; with no limits
// (or no site) it admits every proxy.
type limiter struct {
	p      *pool
	pool   string
	name   string
	limits *events.PerSite
	ss     *siteState
	now    time.Time
	// What held the proxies refused: some at their concurrency (busy),
	// the soonest token of one held only by its rate (refill).
	busy   bool
	refill time.Duration
}

// limiterLocked returns the limiter of target's site in p at now, first
// dropping the state of idle sites once per [sweepEvery].
func (p *pool) limiterLocked(target Target, now time.Time) *limiter {
	if len(p.sites) > 0 && now.Sub(p.swept) >= sweepEvery {
		p.sweepLocked(now)
	}
	l := &limiter{p: p, pool: target.Pool, name: target.Site, now: now}
	if p.spec == nil || p.spec.PerSite == nil || target.Site == "" {
		return l
	}
	l.limits = p.spec.PerSite
	l.ss = p.sites[target.Site]
	if l.ss == nil {
		l.ss = &siteState{proxies: map[string]*proxySite{}}
		p.sites[target.Site] = l.ss
	}
	return l
}

// sweepLocked drops the per-site state that holds nothing: proxies idle
// at a site, sites without proxies or waiters. Memory then follows the
// sites in use, not every site ever seen.
func (p *pool) sweepLocked(now time.Time) {
	p.swept = now
	var limits *events.PerSite
	if p.spec != nil {
		limits = p.spec.PerSite
	}
	for name, ss := range p.sites {
		for id, x := range ss.proxies {
			if x.idle(limits, now) {
				delete(ss.proxies, id)
			}
		}
		if len(ss.proxies) == 0 && ss.wake == nil {
			delete(p.sites, name)
		}
	}
}

// under reports whether proxy id is under its limits at the site.
func (l *limiter) under(id string) bool {
	if l.limits == nil {
		return true
	}
	x := l.ss.proxies[id]
	if x == nil {
		return true
	}
	if l.limits.Concurrency > 0 && x.open >= l.limits.Concurrency {
		l.busy = true
		return false
	}
	if l.limits.Rate > 0 {
		x.refill(l.limits, l.now)
		if x.tokens < 1 {
			wait := time.Duration((1 - x.tokens) / l.limits.Rate * float64(time.Second))
			if l.refill == 0 || wait < l.refill {
				l.refill = max(wait, time.Millisecond)
			}
			return false
		}
	}
	return true
}

// take counts a request of proxy id to the site: one more in flight, one
// token less.
func (l *limiter) take(id string) {
	if l.limits == nil {
		return
	}
	x := l.ss.proxies[id]
	if x == nil {
		x = &proxySite{tokens: float64(l.limits.Burst()), at: l.now}
		l.ss.proxies[id] = x
	}
	x.refill(l.limits, l.now)
	x.open++
	if l.limits.Rate > 0 {
		x.tokens--
	}
}

// site is the site a pick counts against ("" without limits).
func (l *limiter) site() string {
	if l.limits == nil {
		return ""
	}
	return l.name
}

// err is the error of a pick every usable proxy refused.
func (l *limiter) err() error {
	if l.limits == nil {
		return fmt.Errorf("pool %q: %w", l.pool, ErrNoProxy)
	}
	if l.ss.wake == nil {
		l.ss.wake = make(chan struct{})
	}
	e := &LimitError{Pool: l.pool, Site: l.name, Limits: *l.limits, wake: l.ss.wake, refill: l.refill, RetryAfter: time.Second}
	if !l.busy && l.refill > 0 {
		e.RetryAfter = l.refill
	}
	return e
}

// releaseLocked ends a request of proxy id to site and wakes the requests
// waiting for the site.
func (p *pool) releaseLocked(id, site string) {
	ss := p.sites[site]
	if ss == nil {
		return
	}
	if x := ss.proxies[id]; x != nil && x.open > 0 {
		x.open--
	}
	if ss.wake != nil {
		close(ss.wake)
		ss.wake = nil
	}
}

// wakeAllLocked wakes every request waiting for a proxy of p (one joined
// the pool).
func (p *pool) wakeAllLocked() {
	for _, ss := range p.sites {
		if ss.wake != nil {
			close(ss.wake)
			ss.wake = nil
		}
	}
}

// Acquire is [Table.Pick] that waits, up to the pool's
// perSite.queueTimeout, for a proxy under its per-site limits: it tries
// again whenever a request to the site ends, a proxy joins the pool or a
// rate-limited proxy gets its next token. It returns the last
// [*LimitError] when the wait times out, and ctx's error (wrapped) when
// ctx ends first.
func (t *Table) Acquire(ctx context.Context, target Target, exclude ...string) (Proxy, error) {
	var timeout *time.Timer
	for {
		x, err := t.Pick(target, exclude...)
		lerr, ok := errors.AsType[*LimitError](err)
		if !ok {
			return x, err
		}
		if timeout == nil {
			timeout = time.NewTimer(lerr.Limits.QueueTimeoutOrDefault())
			defer timeout.Stop()
		}
		var refill <-chan time.Time
		var r *time.Timer
		if lerr.refill > 0 {
			r = time.NewTimer(lerr.refill)
			refill = r.C
		}
		select {
		case <-ctx.Done():
			err = fmt.Errorf("waiting for a proxy under its limits for site %s: %w", target.Site, ctx.Err())
		case <-timeout.C:
			err = lerr
		case <-lerr.wake:
			err = nil
		case <-refill:
			err = nil
		}
		if r != nil {
			r.Stop()
		}
		if err != nil {
			return Proxy{}, err
		}
	}
}
