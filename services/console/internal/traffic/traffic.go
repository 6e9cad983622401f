// Package traffic sums the gateways' request log (stream
// FLEET_GATEWAY_LOG) over the last minutes: per pool, per site and per
// proxy, the requests, failures and bans, in 10-second slots. The console
// shows the rates of the last minute and the sites failing most over the
// whole window. Memory is bounded: at most [MaxSites] sites per pool and
// slot are told apart, the rest are counted as one.
package traffic

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

const (
	// SlotLen is the length of one slot of counts.
	SlotLen = 10 * time.Second
	// Slots is how many slots are kept: the window of the counts.
	Slots = 30
	// Window is the span the counts cover.
	Window = Slots * SlotLen
	// RateSpan is the span the rates are computed over.
	RateSpan = time.Minute
	// MaxSites bounds the sites told apart per pool and slot.
	MaxSites = 500
	// MaxProxies bounds the proxies told apart per pool and slot.
	MaxProxies = 20_000
	// OtherSites names the sites counted together past MaxSites.
	OtherSites = "(other sites)"
	// NoPool names the requests whose client named no valid pool.
	NoPool = "(no pool)"
)

// Counts are requests and how many of them failed or were banned.
type Counts struct {
	Requests, Failures, Bans int64
}

func (c *Counts) add(o Counts) {
	c.Requests += o.Requests
	c.Failures += o.Failures
	c.Bans += o.Bans
}

type poolSlot struct {
	Counts
	sites   map[string]*Counts
	proxies map[string]*Counts
}

type slot struct {
	start int64 // unix time / SlotLen
	pools map[string]*poolSlot
}

// Stats is the sum of the request log. It is safe for concurrent use.
type Stats struct {
	mu    sync.RWMutex
	slots [Slots]slot
	// seen is whether any record arrived; stream whether the request log
	// stream exists.
	seen, stream bool
	gen          uint64
	now          func() time.Time
}

// New returns empty stats.
func New() *Stats { return &Stats{now: time.Now} }

// Gen changes whenever a record is added.
func (s *Stats) Gen() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.gen
}

// HasLog reports whether the request log stream exists, and whether any
// record of the window arrived.
func (s *Stats) HasLog() (stream, records bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.stream, s.seen
}

func (s *Stats) setStream(ok bool) {
	s.mu.Lock()
	s.stream = ok
	s.mu.Unlock()
}

// failed reports whether a record counts as a failure: the client got the
// gateway's or a proxy's error rather than the site's answer.
func failed(r events.GatewayRequest) bool {
	return r.Outcome == events.RequestError || r.Outcome == events.RequestProxyError
}

// Add counts one record.
func (s *Stats) Add(r events.GatewayRequest) {
	at := r.Time
	if at.IsZero() {
		at = s.now()
	}
	idx := at.UnixNano() / int64(SlotLen)
	s.mu.Lock()
	defer s.mu.Unlock()
	nowIdx := s.now().UnixNano() / int64(SlotLen)
	if idx <= nowIdx-Slots || idx > nowIdx+1 {
		return // outside the window
	}
	sl := &s.slots[idx%Slots]
	if sl.start != idx || sl.pools == nil {
		*sl = slot{start: idx, pools: map[string]*poolSlot{}}
	}
	pool := r.Pool
	if pool == "" {
		pool = NoPool
	}
	ps := sl.pools[pool]
	if ps == nil {
		ps = &poolSlot{sites: map[string]*Counts{}, proxies: map[string]*Counts{}}
		sl.pools[pool] = ps
	}
	c := Counts{Requests: 1}
	if failed(r) {
		c.Failures = 1
	}
	if r.Ban != "" {
		c.Bans = 1
	}
	ps.add(c)
	site := r.Site
	if site == "" {
		site = r.Host
	}
	sc := ps.sites[site]
	if sc == nil {
		if len(ps.sites) >= MaxSites {
			site = OtherSites
			sc = ps.sites[site]
		}
		if sc == nil {
			sc = &Counts{}
			ps.sites[site] = sc
		}
	}
	sc.add(c)
	// Every proxy tried carried one attempt: those before the last failed
	// over; the last one has the request's outcome.
	for i, id := range r.Proxies {
		pc := ps.proxies[id]
		if pc == nil {
			if len(ps.proxies) >= MaxProxies {
				continue
			}
			pc = &Counts{}
			ps.proxies[id] = pc
		}
		if i < len(r.Proxies)-1 {
			pc.add(Counts{Requests: 1, Failures: 1})
		} else {
			pc.add(c)
		}
	}
	s.seen = true
	s.gen++
}

// Rate is counts over a span, per second.
type Rate struct {
	Counts
	// Span is the time the counts cover; zero for no counts.
	Span time.Duration
}

func (r Rate) per(n int64) float64 {
	if r.Span <= 0 {
		return 0
	}
	return float64(n) / r.Span.Seconds()
}

// PerSecond is the requests per second.
func (r Rate) PerSecond() float64 { return r.per(r.Requests) }

// FailuresPerSecond is the failures per second.
func (r Rate) FailuresPerSecond() float64 { return r.per(r.Failures) }

// BansPerSecond is the bans per second.
func (r Rate) BansPerSecond() float64 { return r.per(r.Bans) }

// FailureShare is the share of the requests that failed (0 without any).
func (r Rate) FailureShare() float64 {
	if r.Requests == 0 {
		return 0
	}
	return float64(r.Failures) / float64(r.Requests)
}

// BanShare is the share of the requests that were banned.
func (r Rate) BanShare() float64 {
	if r.Requests == 0 {
		return 0
	}
	return float64(r.Bans) / float64(r.Requests)
}

// each calls fn with every pool slot of the last span/SlotLen slots, the
// current one included, and returns the time those slots cover so far:
// the current slot has only begun.
func (s *Stats) each(span time.Duration, fn func(pool string, ps *poolSlot)) time.Duration {
	now := s.now().UnixNano()
	nowIdx := now / int64(SlotLen)
	n := int64(span / SlotLen)
	for i := range s.slots {
		sl := &s.slots[i]
		if sl.pools == nil || sl.start <= nowIdx-n || sl.start > nowIdx {
			continue
		}
		for p, ps := range sl.pools {
			fn(p, ps)
		}
	}
	covered := time.Duration(n-1)*SlotLen + time.Duration(now-nowIdx*int64(SlotLen))
	return max(covered, time.Second)
}

// Pools returns each pool's rate over the last [RateSpan].
func (s *Stats) Pools() map[string]Rate {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string]Rate{}
	span := s.each(RateSpan, func(pool string, ps *poolSlot) {
		r := out[pool]
		r.add(ps.Counts)
		out[pool] = r
	})
	for p, r := range out {
		r.Span = span
		out[p] = r
	}
	return out
}

// Proxies returns the counts of pool's proxies over the whole [Window].
func (s *Stats) Proxies(pool string) map[string]Counts {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string]Counts{}
	s.each(Window, func(p string, ps *poolSlot) {
		if p != pool {
			return
		}
		for id, c := range ps.proxies {
			t := out[id]
			t.add(*c)
			out[id] = t
		}
	})
	return out
}

// SiteRate is one site of one pool.
type SiteRate struct {
	Pool, Site string
	Rate
}

// Sites returns the rate of every pool and site over span, by pool, then
// by requests, most first.
func (s *Stats) Sites(span time.Duration) []SiteRate {
	s.mu.RLock()
	defer s.mu.RUnlock()
	m := map[[2]string]*SiteRate{}
	covered := s.each(span, func(pool string, ps *poolSlot) {
		for site, c := range ps.sites {
			k := [2]string{pool, site}
			r := m[k]
			if r == nil {
				r = &SiteRate{Pool: pool, Site: site}
				m[k] = r
			}
			r.add(*c)
		}
	})
	out := make([]SiteRate, 0, len(m))
	for _, r := range m {
		r.Span = covered
		out = append(out, *r)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Pool != out[j].Pool {
			return out[i].Pool < out[j].Pool
		}
		if out[i].Requests != out[j].Requests {
			return out[i].Requests > out[j].Requests
		}
		return out[i].Site < out[j].Site
	})
	return out
}

// TopFailing returns at most n sites with failures or bans over the whole
// [Window], the most failures and bans first.
func (s *Stats) TopFailing(n int) []SiteRate {
	all := s.Sites(Window)
	out := all[:0]
	for _, r := range all {
		if r.Failures+r.Bans > 0 {
			out = append(out, r)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Failures+out[i].Bans > out[j].Failures+out[j].Bans })
	if len(out) > n {
		out = out[:n]
	}
	return out
}

// Follower feeds [Stats] from the request log stream.
type Follower struct {
	js    jetstream.JetStream
	stats *Stats
	log   *slog.Logger
	// next is the stream sequence after the last record read (0: none).
	next uint64
}

// NewFollower returns a follower of js's request log into stats.
func NewFollower(js jetstream.JetStream, stats *Stats, log *slog.Logger) *Follower {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Follower{js: js, stats: stats, log: log}
}

// Run reads the request log from [Window] ago on, until ctx ends; while
// the stream does not exist (no gateway keeps a log), it looks again now
// and then.
func (f *Follower) Run(ctx context.Context) error {
	pause := time.Second
	for ctx.Err() == nil {
		err := f.read(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			f.stats.setStream(false)
			pause = 10 * time.Second
		} else {
			f.log.Warn("reading the request log stopped; reading it again", "err", err, "retry_in", pause.String())
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pause):
		}
		pause = min(2*pause, 30*time.Second)
	}
	return nil
}

// read reads the request log from where the last read ended, or from
// [Window] ago at first: a read that starts again counts nothing twice.
func (f *Follower) read(ctx context.Context) error {
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{events.GatewayLogAll}}
	if f.next > 0 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, f.next
	} else {
		start := f.stats.now().Add(-Window)
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &start
	}
	cons, err := f.js.OrderedConsumer(ctx, bus.RequestLogStream, cfg)
	if err != nil {
		return err
	}
	f.stats.setStream(true)
	it, err := cons.Messages()
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	defer it.Stop()
	for {
		msg, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if md, err := msg.Metadata(); err == nil {
			f.next = md.Sequence.Stream + 1
		}
		var r events.GatewayRequest
		if json.Unmarshal(msg.Data(), &r) != nil {
			continue
		}
		f.stats.Add(r)
	}
}
