package decide

import (
	"time"

	"proxyfleet/pkg/events"
)

// Config is the rules' tuning: the planner's timeouts.
type Config struct {
	// CreateTimeout: a proxy requested this long has its create issued
	// again.
	CreateTimeout time.Duration
	// ProvisionTimeout: a proxy provisioning this long fails (timeout).
	ProvisionTimeout time.Duration
	// ReadyTimeout: a proxy running this long without one passed probe
	// fails (timeout).
	ReadyTimeout time.Duration
	// RetireTimeout: a proxy retiring this long has its delete issued
	// again.
	RetireTimeout time.Duration
	// QuotaAvoid: how long a target that answered quota, or where a
	// create got stuck, takes no new proxy.
	QuotaAvoid time.Duration
	// MaxCreateAttempts: a create issued this many times without reaching
	// provisioning fails the proxy (stuck).
	MaxCreateAttempts int
	// StuckDeletes: a retiring proxy whose delete was re-issued this many
	// times without it being deleted is stuck ([IsDeleteStuck]); 0: never.
	StuckDeletes int
}

// Pool is the view of one pool the rules read.
type Pool struct {
	Name     string          `json:"name"`
	Spec     events.PoolSpec `json:"spec"`
	Revision int             `json:"revision"`
	Deleted  bool            `json:"deleted"`
	// LastSeq is the sequence of the pool's last event: decisions about
	// the pool (its conditions) expect it.
	LastSeq uint64 `json:"lastSeq"`
	// ShapeRevision is the revision at which the instance-shaping part of
	// the spec last changed. A proxy requested at an older revision is
	// outdated and is rolled.
	ShapeRevision int `json:"shapeRevision"`
	// Conditions are the pool's conditions as the log holds them.
	Conditions []events.Condition `json:"conditions,omitempty"`
	// Autoscaled is the number of proxies an autoscaled pool wants, as
	// its last applied or scaled event left it; 0 for a pool without
	// autoscale. See [Pool.Size].
	Autoscaled int `json:"autoscaled,omitempty"`
	// ScaleReason is the reason of the last scaled event since the pool
	// became autoscaled.
	ScaleReason string `json:"scaleReason,omitempty"`
}

// Size is the number of proxies the pool wants: its spec's size, or for
// an autoscaled pool the size autoscaling set (never outside [min, max]).
func (p *Pool) Size() int {
	a := p.Spec.Autoscale
	switch {
	case a == nil:
		return p.Spec.Size
	case p.Autoscaled == 0:
		return a.Clamp(p.Spec.Size)
	}
	return a.Clamp(p.Autoscaled)
}

// Want is how many proxies the pool wants now: none once it is deleted.
func (p *Pool) Want() int {
	if p.Deleted {
		return 0
	}
	return p.Size()
}

// IsOutdated reports whether proxy x was requested before the last change
// of the pool's instance shape.
func (p *Pool) IsOutdated(x Proxy) bool { return x.Revision < p.ShapeRevision }

// Proxy is the view of one proxy the rules read.
type Proxy struct {
	events.ProxyView
	// LastSeq is the sequence of the aggregate's last event: decisions
	// about the proxy expect it.
	LastSeq uint64 `json:"-"`
	// DeleteAttempt counts the retiring decisions: the next delete
	// command's attempt.
	DeleteAttempt int `json:"-"`
	// RetiringSince is when the proxy's first retiring decision was
	// recorded; zero unless it is retiring.
	RetiringSince time.Time `json:"-"`
	// DeleteFailure is the last failure recorded while it was retiring
	// (its agent's failed observation of the delete, or a dead letter):
	// "<class>: <reason>"; "" when none.
	DeleteFailure string `json:"-"`
}

// IsDeleteStuck reports whether retiring proxy x had its delete re-issued
// cfg.StuckDeletes times and is still not deleted.
func IsDeleteStuck(cfg Config, x Proxy) bool {
	return cfg.StuckDeletes > 0 && x.State == events.ProxyRetiring && !x.SkipCleanup && x.DeleteAttempt-1 >= cfg.StuckDeletes
}

// IsActive reports whether a proxy in state s counts toward its pool's
// size.
func IsActive(s string) bool {
	switch s {
	case events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
		return true
	}
	return false
}

// Target is one live agent target: what it offers and whether it can
// receive sealed secrets.
type Target struct {
	Entry, Target string
	Images        []string
	Profiles      []string
	// Capacity is how many active proxies it takes at most; 0: no limit.
	Capacity int
	// XKey is the curve key it announced to seal secrets to; "" when none.
	XKey string
	// Check is the target's latest check verdict (health's record in
	// fleet-targets), nil when there is none.
	Check *Check
	// Labels are the labels the target announced (region, country,
	// provider, …); nil when none.
	Labels map[string]string
}

// Check is health's latest poll of a target agent's checks.
type Check struct {
	// OK is true when the agent answered and every check passed.
	OK bool
	// At is when health polled the agent.
	At time.Time
	// Failing names each failing check, with its detail ("pool: not
	// running"), or why the agent gave no answer.
	Failing []string
}

// Key is the target's "<entry>.<target>".
func (t Target) Key() string { return TargetKey(t.Entry, t.Target) }

// TargetKey is the key of target target of entry entry.
func TargetKey(entry, target string) string { return entry + "." + target }

// Avoidance is a recent failure that keeps placement off a target: its
// class (quota or stuck) and when it was recorded.
type Avoidance struct {
	Class string
	At    time.Time
}

// Load is how many active proxies each target ("<entry>.<target>") holds:
// All counts every pool's, Pool this pool's.
type Load struct {
	All, Pool map[string]int
}

// Miss is why a proxy of a pool cannot be placed: a Placed condition
// reason and a message naming the targets considered.
type Miss struct {
	Reason, Message string
}
