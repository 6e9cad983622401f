// Package crawlload is crawler traffic through several gateways, for the
// tiers that check the gateways keep serving through a fault or a change
// (make test-upgrade, make test-partitions). Each worker sends its
// requests to one gateway after another and retries a failed request once
// through the next gateway, as a crawler given every gateway's address
// does. Every request is kept with the time it was sent and its outcome:
// ok at the first try, retried (ok through the next gateway) or failed
// (both tries failed).
package crawlload

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"
)

// Outcome is how a request ended.
type Outcome string

const (
	OK      Outcome = "ok"      // through its first gateway
	Retried Outcome = "retried" // failed there, then ok through the next
	Failed  Outcome = "failed"  // failed through both
)

// Request is one request of the load.
type Request struct {
	Sent    time.Time
	Gateway int // the gateway of the first try
	Outcome Outcome
	Err     string // both tries' errors, for a failed request
}

// Options shape the load's clients.
type Options struct {
	// Timeout bounds each try (default 10 s).
	Timeout time.Duration
	// DialTimeout bounds each connection's dial (default 3 s).
	DialTimeout time.Duration
	// NewConnEachRequest sends every request on a new connection, so a
	// gateway routes each afresh and a gateway cut off mid-connection is
	// noticed at the next request.
	NewConnEachRequest bool
}

// Load sends requests for target through gateways.
type Load struct {
	target  string
	clients []*http.Client // per gateway
	stop    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	reqs    []Request
}

// New returns a load of requests for target (an origin answering "ok")
// through n gateways; proxy names gateway i's proxy URL (with the pool
// as user), asked at each request, so a gateway may move while the load
// runs.
func New(target string, n int, proxy func(gw int) *url.URL, o Options) *Load {
	if o.Timeout == 0 {
		o.Timeout = 10 * time.Second
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = 3 * time.Second
	}
	l := &Load{target: target, stop: make(chan struct{})}
	for gw := range n {
		l.clients = append(l.clients, &http.Client{Timeout: o.Timeout, Transport: &http.Transport{
			Proxy:             func(*http.Request) (*url.URL, error) { return proxy(gw), nil },
			DialContext:       (&net.Dialer{Timeout: o.DialTimeout}).DialContext,
			DisableKeepAlives: o.NewConnEachRequest,
		}})
	}
	return l
}

// Once sends one request through gateway gw, outside the load's record;
// it fails unless the answer is 200 "ok".
func (l *Load) Once(gw int) error {
	resp, err := l.clients[gw].Get(l.target)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || string(b) != "ok" {
		return fmt.Errorf("status %d, body %.80q", resp.StatusCode, b)
	}
	return nil
}

// Run starts workers that each send a request every pace until End.
// Worker w starts at gateway w and moves to the next one each request.
func (l *Load) Run(workers int, pace time.Duration) {
	for w := range workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for n := w; ; n++ {
				select {
				case <-l.stop:
					return
				case <-time.After(pace):
				}
				l.record(l.try(n % len(l.clients)))
			}
		}()
	}
}

// try sends one request through gw, and once more through the next
// gateway if that failed.
func (l *Load) try(gw int) Request {
	r := Request{Sent: time.Now(), Gateway: gw, Outcome: OK}
	err := l.Once(gw)
	if err == nil {
		return r
	}
	r.Outcome = Retried
	next := (gw + 1) % len(l.clients)
	if err2 := l.Once(next); err2 != nil {
		r.Outcome = Failed
		r.Err = fmt.Sprintf("gateway %d: %v; retry on gateway %d: %v", gw+1, err, next+1, err2)
	}
	return r
}

func (l *Load) record(r Request) {
	l.mu.Lock()
	l.reqs = append(l.reqs, r)
	l.mu.Unlock()
}

// End stops the workers and waits for their last requests.
func (l *Load) End() {
	close(l.stop)
	l.wg.Wait()
}

// Count is the number of requests recorded so far.
func (l *Load) Count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.reqs)
}

// Between counts the requests sent in [from, to) by outcome (a zero to
// means no end), and returns up to maxErrs of the failed ones' errors.
func (l *Load) Between(from, to time.Time, maxErrs int) (counts map[Outcome]int, errs []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	counts = map[Outcome]int{}
	for _, r := range l.reqs {
		if r.Sent.Before(from) || (!to.IsZero() && !r.Sent.Before(to)) {
			continue
		}
		counts[r.Outcome]++
		if r.Outcome == Failed && len(errs) < maxErrs {
			errs = append(errs, r.Err)
		}
	}
	return counts, errs
}

// FirstOK is when the first request sent at or after since went through
// gateway gw at its first try, or the zero time if none has yet.
func (l *Load) FirstOK(gw int, since time.Time) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	var first time.Time
	for _, r := range l.reqs {
		if r.Gateway == gw && r.Outcome == OK && !r.Sent.Before(since) && (first.IsZero() || r.Sent.Before(first)) {
			first = r.Sent
		}
	}
	return first
}
