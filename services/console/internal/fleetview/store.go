// Package fleetview follows the fleet's KV views (fleet-pools,
// fleet-proxies, fleet-probes, fleet-targets, fleet-agents, fleet-health,
// fleet-demand) into memory, with the indexes the console's pages read:
// each pool's proxies sorted by id, its counts per state, and a short
// history of ready against desired. A page reads a page of proxies by
// binary search in the sorted index, never by scanning a bucket.
//
// Nothing secret is kept: a pool's spec is reduced to its public part
// ([events.PoolSpec.Public]) and external proxy URLs lose their user
// information on the way in, whatever the view holds.
package fleetview

import (
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/events"
)

// Pool is one pool as the console shows it: the fleet-pools value with
// nothing secret in it.
type Pool struct {
	Name        string             `json:"name"`
	Provider    string             `json:"provider"`
	Size        int                `json:"size"`
	ScaleReason string             `json:"scaleReason,omitempty"`
	ScaledAt    time.Time          `json:"scaledAt,omitzero"`
	Spec        events.PoolSpec    `json:"spec"`
	Revision    int                `json:"revision"`
	Conditions  []events.Condition `json:"conditions,omitempty"`
	CreatedAt   time.Time          `json:"createdAt"`
	UpdatedAt   time.Time          `json:"updatedAt"`
	// HasSecrets is true when the pool has a password, user-data or
	// external credentials (its view records their digest): re-applying
	// its public spec would drop them, so the console does not scale it.
	HasSecrets bool `json:"-"`
}

// Probe is what the console shows of a proxy's fleet-probes record.
type Probe struct {
	OK        bool      `json:"ok"`
	LatencyMS int64     `json:"latencyMs"`
	EgressIP  string    `json:"egressIP,omitempty"`
	Streak    int       `json:"streak"`
	LastError string    `json:"lastError,omitempty"`
	CheckedAt time.Time `json:"checkedAt"`
}

// Agent is an agent's heartbeat (fleet-agents, key "<entry>.<target>").
type Agent struct {
	Entry     string            `json:"entry"`
	Target    string            `json:"target"`
	Type      string            `json:"type"`
	Images    []string          `json:"images,omitempty"`
	Profiles  []string          `json:"profiles,omitempty"`
	Capacity  int               `json:"capacity"`
	Version   string            `json:"version,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Instances int               `json:"instances"`
	StartedAt time.Time         `json:"startedAt"`
	At        time.Time         `json:"at"`
}

// Verdict is one check of a target.
type Verdict struct {
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail,omitempty"`
}

// TargetCheck is health's last poll of a target's checks (fleet-targets).
type TargetCheck struct {
	Entry    string    `json:"entry"`
	Target   string    `json:"target"`
	Verdicts []Verdict `json:"verdicts"`
	OK       bool      `json:"ok"`
	At       time.Time `json:"at"`
	Error    string    `json:"error,omitempty"`
}

// Demand is one gateway's report of one pool's traffic (fleet-demand).
type Demand struct {
	Pool              string    `json:"pool"`
	Gateway           string    `json:"gateway"`
	Connections       int       `json:"connections"`
	RequestsPerSecond float64   `json:"requestsPerSecond"`
	At                time.Time `json:"at"`
}

// Cooldown is one proxy kept off one site by a gateway's ban rule
// (fleet-gateway-cooldowns): until Until, no gateway sends the site through
// it.
type Cooldown struct {
	Proxy   string    `json:"proxy"`
	Pool    string    `json:"pool"`
	Site    string    `json:"site"`
	Rule    string    `json:"rule"`
	Gateway string    `json:"gateway"`
	At      time.Time `json:"at"`
	Until   time.Time `json:"until"`
}

// Sample is one point of a pool's history.
type Sample struct {
	At      time.Time
	Desired int
	Ready   int
}

// HistoryLen is how many samples of each pool's history are kept.
const HistoryLen = 60

// poolIndex is everything kept per pool name: the pool's view (nil while
// only proxies name it: a deleted pool still retiring them), its proxies'
// ids in order, its counts per state and its history.
type poolIndex struct {
	pool    *Pool
	ids     []string // sorted
	states  map[string]int
	history []Sample // oldest first, at most HistoryLen
	gen     uint64
}

// Store is the console's copy of the views. It is safe for concurrent
// use: the watches write, the pages read.
type Store struct {
	mu      sync.RWMutex
	pools   map[string]*poolIndex
	proxies map[string]*events.ProxyView
	probes  map[string]Probe
	agents  map[string]Agent
	checks  map[string]TargetCheck
	health  map[string]time.Time // health replica -> when its key was written
	demand  map[string]Demand    // "<pool>.<gateway>"
	// cooldowns are by proxy, then by their key "<proxy>.<site>".
	cooldowns map[string]map[string]Cooldown
	synced    map[string]bool // bucket -> its initial values are in
	// gen counts changes of anything; targetsGen those of agents, checks
	// and health replicas. Readers compare them to tell whether what they
	// show changed (the live pages poll them: a burst of changes costs
	// them nothing).
	gen, targetsGen uint64
}

// New returns an empty store.
func New() *Store {
	return &Store{
		pools: map[string]*poolIndex{}, proxies: map[string]*events.ProxyView{}, probes: map[string]Probe{},
		agents: map[string]Agent{}, checks: map[string]TargetCheck{}, health: map[string]time.Time{},
		demand: map[string]Demand{}, cooldowns: map[string]map[string]Cooldown{}, synced: map[string]bool{},
	}
}

// Gen is a number that changes whenever anything in the store does.
func (s *Store) Gen() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.gen
}

// PoolGen is a number that changes whenever pool name, one of its proxies
// or one of their probes changes.
func (s *Store) PoolGen(name string) uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if p := s.pools[name]; p != nil {
		return p.gen
	}
	return 0
}

// TargetsGen is a number that changes whenever an agent, a target's
// checks or the health replicas change.
func (s *Store) TargetsGen() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.targetsGen
}

// Synced reports whether the initial values of bucket are in.
func (s *Store) Synced(bucket string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.synced[bucket]
}

func (s *Store) index(name string) *poolIndex {
	p := s.pools[name]
	if p == nil {
		p = &poolIndex{states: map[string]int{}}
		s.pools[name] = p
	}
	return p
}

// dropIfEmpty forgets a pool index that has neither a view nor proxies.
func (s *Store) dropIfEmpty(name string) {
	if p := s.pools[name]; p != nil && p.pool == nil && len(p.ids) == 0 {
		delete(s.pools, name)
	}
}

func (s *Store) changed(pool string) {
	s.gen++
	if pool != "" {
		if p := s.pools[pool]; p != nil {
			p.gen = s.gen
		}
	}
}

// PutPool records the fleet-pools value of pool name (nil: deleted).
func (s *Store) PutPool(name string, v *Pool) {
	s.mu.Lock()
	if v == nil {
		if p := s.pools[name]; p != nil {
			p.pool = nil
			s.changed(name)
			s.dropIfEmpty(name)
		}
	} else {
		clean := scrubPool(*v)
		p := s.index(name)
		p.pool = &clean
		s.changed(name)
	}
	s.mu.Unlock()
}

// scrubPool keeps only the public part of a pool's spec, whatever the
// view held: no password, no user-data, no credentials in external URLs.
func scrubPool(v Pool) Pool {
	v.Spec = v.Spec.Public()
	if ext := v.Spec.External; ext != nil {
		for i := range ext.Proxies {
			ext.Proxies[i].URL = StripUserinfo(ext.Proxies[i].URL)
		}
	}
	v.Conditions = slices.Clone(v.Conditions)
	return v
}

// StripUserinfo returns raw without the user and password of a URL; a
// value that does not parse as a URL with a host is replaced by a
// placeholder rather than shown, since it might hold them.
func StripUserinfo(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		if strings.ContainsAny(raw, "@:") {
			return "(unreadable URL)"
		}
		return raw
	}
	u.User = nil
	return u.String()
}

// PutProxy records the fleet-proxies value of proxy id (nil: deleted).
func (s *Store) PutProxy(id string, v *events.ProxyView) {
	s.mu.Lock()
	old := s.proxies[id]
	if old != nil {
		p := s.pools[old.Pool]
		if v == nil || v.Pool != old.Pool {
			p.ids = removeSorted(p.ids, id)
		}
		p.states[old.State]--
		if p.states[old.State] <= 0 {
			delete(p.states, old.State)
		}
	}
	if v == nil {
		delete(s.proxies, id)
		delete(s.probes, id)
		if old != nil {
			s.changed(old.Pool)
			s.dropIfEmpty(old.Pool)
		}
	} else {
		c := *v
		p := s.index(c.Pool)
		if old == nil || old.Pool != c.Pool {
			p.ids = insertSorted(p.ids, id)
		}
		p.states[c.State]++
		s.proxies[id] = &c
		s.changed(c.Pool)
		if old != nil && old.Pool != c.Pool {
			s.changed(old.Pool)
			s.dropIfEmpty(old.Pool)
		}
	}
	s.mu.Unlock()
}

func insertSorted(ids []string, id string) []string {
	i, found := slices.BinarySearch(ids, id)
	if found {
		return ids
	}
	return slices.Insert(ids, i, id)
}

func removeSorted(ids []string, id string) []string {
	i, found := slices.BinarySearch(ids, id)
	if !found {
		return ids
	}
	return slices.Delete(ids, i, i+1)
}

// PutProbe records the fleet-probes value of proxy id (nil: deleted).
func (s *Store) PutProbe(id string, v *Probe) {
	s.mu.Lock()
	if v == nil {
		delete(s.probes, id)
	} else {
		s.probes[id] = *v
	}
	pool := ""
	if px := s.proxies[id]; px != nil {
		pool = px.Pool
	}
	s.changed(pool)
	s.mu.Unlock()
}

// PutAgent records the heartbeat under key "<entry>.<target>" (nil: gone).
func (s *Store) PutAgent(key string, v *Agent) {
	s.mu.Lock()
	if v == nil {
		delete(s.agents, key)
	} else {
		s.agents[key] = *v
	}
	s.gen++
	s.targetsGen = s.gen
	s.mu.Unlock()
}

// PutCheck records a target's checks under key "<entry>.<target>" (nil:
// gone).
func (s *Store) PutCheck(key string, v *TargetCheck) {
	s.mu.Lock()
	if v == nil {
		delete(s.checks, key)
	} else {
		s.checks[key] = *v
	}
	s.gen++
	s.targetsGen = s.gen
	s.mu.Unlock()
}

// PutHealth records that health replica id renewed its key at at (zero:
// it left or lapsed).
func (s *Store) PutHealth(id string, at time.Time) {
	s.mu.Lock()
	if at.IsZero() {
		delete(s.health, id)
	} else {
		s.health[id] = at
	}
	s.gen++
	s.targetsGen = s.gen
	s.mu.Unlock()
}

// PutDemand records one gateway's demand report under key
// "<pool>.<gateway>" (nil: expired).
func (s *Store) PutDemand(key string, v *Demand) {
	s.mu.Lock()
	pool, _, _ := strings.Cut(key, ".")
	if v == nil {
		delete(s.demand, key)
	} else {
		s.demand[key] = *v
		pool = v.Pool
	}
	s.changed(pool)
	s.mu.Unlock()
}

// PutCooldown records the fleet-gateway-cooldowns value under key
// "<proxy>.<site>" (nil: deleted).
func (s *Store) PutCooldown(key string, v *Cooldown) {
	proxy, _, _ := strings.Cut(key, ".")
	s.mu.Lock()
	if v == nil {
		if m := s.cooldowns[proxy]; m != nil {
			delete(m, key)
			if len(m) == 0 {
				delete(s.cooldowns, proxy)
			}
		}
	} else {
		m := s.cooldowns[proxy]
		if m == nil {
			m = map[string]Cooldown{}
			s.cooldowns[proxy] = m
		}
		m[key] = *v
	}
	pool := ""
	if px := s.proxies[proxy]; px != nil {
		pool = px.Pool
	} else if v != nil {
		pool = v.Pool
	}
	s.changed(pool)
	s.mu.Unlock()
}

// Cooldowns returns the cooldowns in force at now, the latest to end
// first: of proxy id, or of every proxy when id is "".
func (s *Store) Cooldowns(id string, now time.Time) []Cooldown {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []Cooldown
	add := func(m map[string]Cooldown) {
		for _, c := range m {
			if c.Until.After(now) {
				out = append(out, c)
			}
		}
	}
	if id != "" {
		add(s.cooldowns[id])
	} else {
		for _, m := range s.cooldowns {
			add(m)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Until.Equal(out[j].Until) {
			return out[i].Until.After(out[j].Until)
		}
		return out[i].Proxy+out[i].Site < out[j].Proxy+out[j].Site
	})
	return out
}

// markSynced notes that bucket's initial values are in.
func (s *Store) markSynced(bucket string) {
	s.mu.Lock()
	s.synced[bucket] = true
	s.gen++
	s.mu.Unlock()
}

// Counts are a pool's proxies as the fleet page shows them.
type Counts struct {
	// Desired is the number of proxies the pool wants.
	Desired int
	// Ready counts the proxies in state ready; Live every proxy in the
	// view (all states but deleted and abandoned, which leave it).
	Ready, Live int
	States      map[string]int
}

// PoolSummary is one pool of the fleet page.
type PoolSummary struct {
	Name string
	// Pool is nil for a pool deleted while proxies of it are retiring.
	Pool    *Pool
	Counts  Counts
	History []Sample
	// RequestsPerSecond and Connections are the sums of the gateways'
	// fresh demand reports of the pool.
	RequestsPerSecond float64
	Connections       int
	Gateways          int
}

// Pools returns every pool, by name.
func (s *Store) Pools(now time.Time) []PoolSummary {
	s.mu.RLock()
	defer s.mu.RUnlock()
	names := make([]string, 0, len(s.pools))
	for n := range s.pools {
		names = append(names, n)
	}
	sort.Strings(names)
	out := make([]PoolSummary, 0, len(names))
	for _, n := range names {
		out = append(out, s.summaryLocked(n, now))
	}
	return out
}

// Pool returns the summary of pool name; ok is false when the store
// knows neither the pool nor proxies of it.
func (s *Store) Pool(name string, now time.Time) (PoolSummary, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.pools[name] == nil {
		return PoolSummary{}, false
	}
	return s.summaryLocked(name, now), true
}

// demandFresh is how old a demand report may be and still count: the
// bucket's TTL drops a stopped gateway's keys at about this age.
const demandFresh = 15 * time.Second

func (s *Store) summaryLocked(name string, now time.Time) PoolSummary {
	p := s.pools[name]
	sum := PoolSummary{Name: name, History: slices.Clone(p.history)}
	if p.pool != nil {
		c := *p.pool
		sum.Pool = &c
		sum.Counts.Desired = c.Size
	}
	sum.Counts.States = make(map[string]int, len(p.states))
	for st, n := range p.states {
		sum.Counts.States[st] = n
	}
	sum.Counts.Ready = p.states[events.ProxyReady]
	sum.Counts.Live = len(p.ids)
	for _, d := range s.demand {
		if d.Pool == name && now.Sub(d.At) < demandFresh {
			sum.RequestsPerSecond += d.RequestsPerSecond
			sum.Connections += d.Connections
			sum.Gateways++
		}
	}
	return sum
}

// ProxyRow is one proxy of a pool page.
type ProxyRow struct {
	Proxy events.ProxyView
	// Cooling counts the sites the gateways keep off the proxy now.
	Cooling int
	// Probe is the proxy's last probe; HasProbe is false before the first.
	Probe    Probe
	HasProbe bool
}

// Page is one page of a pool's proxies in id order.
type Page struct {
	Rows []ProxyRow
	// Offset is the index of the first row among the pool's proxies;
	// Total their number.
	Offset, Total int
	// Next is the id to pass as after for the next page; "" on the last.
	Next string
}

// Proxies returns at most limit proxies of pool, in id order, after the
// id after ("" for the first page). It finds the start by binary search
// in the pool's sorted index.
func (s *Store) Proxies(pool, after string, limit int) Page {
	now := time.Now()
	s.mu.RLock()
	defer s.mu.RUnlock()
	p := s.pools[pool]
	if p == nil {
		return Page{}
	}
	start := 0
	if after != "" {
		i, found := slices.BinarySearch(p.ids, after)
		if found {
			i++
		}
		start = i
	}
	end := min(start+limit, len(p.ids))
	pg := Page{Offset: start, Total: len(p.ids), Rows: make([]ProxyRow, 0, end-start)}
	for _, id := range p.ids[start:end] {
		row := ProxyRow{Proxy: *s.proxies[id]}
		row.Probe, row.HasProbe = s.probes[id]
		for _, c := range s.cooldowns[id] {
			if c.Until.After(now) {
				row.Cooling++
			}
		}
		pg.Rows = append(pg.Rows, row)
	}
	if end < len(p.ids) && end > start {
		pg.Next = p.ids[end-1]
	}
	return pg
}

// Proxy returns the view of proxy id.
func (s *Store) Proxy(id string) (events.ProxyView, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v := s.proxies[id]
	if v == nil {
		return events.ProxyView{}, false
	}
	return *v, true
}

// PoolOf returns the pool of proxy id, "" when the view does not hold it.
func (s *Store) PoolOf(id string) string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if v := s.proxies[id]; v != nil {
		return v.Pool
	}
	return ""
}

// Target is one target of the targets page: its agent's heartbeat, its
// checks, and the proxies placed on it.
type Target struct {
	Key      string
	Agent    *Agent
	Check    *TargetCheck
	Proxies  int
	Entry    string
	TargetID string
	// Live is whether the agent's heartbeat is fresh.
	Live bool
}

// AgentFresh is how old an agent's heartbeat may be and the agent still
// count as alive: fleet-agents drops a key some 15s after its last
// heartbeat without telling its watchers.
const AgentFresh = 30 * time.Second

// HealthFresh is how long a health replica counts as alive after it last
// renewed its key (every beat, a few seconds at most): fleet-health drops
// a lapsed key without telling its watchers either.
const HealthFresh = 10 * time.Second

// Targets returns every target an agent announced or health checked, by
// key, and the live health replicas with the time each last renewed. An
// agent whose last heartbeat is older than [AgentFresh] is not alive:
// its Agent is kept and Live is false.
func (s *Store) Targets() ([]Target, map[string]time.Time) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	keys := map[string]bool{}
	for k := range s.agents {
		keys[k] = true
	}
	for k := range s.checks {
		keys[k] = true
	}
	placed := map[string]int{}
	for _, v := range s.proxies {
		placed[v.Entry+"."+v.Target]++
	}
	out := make([]Target, 0, len(keys))
	now := time.Now()
	for k := range keys {
		t := Target{Key: k, Proxies: placed[k]}
		t.Entry, t.TargetID, _ = strings.Cut(k, ".")
		if a, ok := s.agents[k]; ok {
			t.Agent = &a
			t.Live = now.Sub(a.At) < AgentFresh
		}
		if c, ok := s.checks[k]; ok {
			t.Check = &c
		}
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	health := make(map[string]time.Time, len(s.health))
	for k, v := range s.health {
		if now.Sub(v) < HealthFresh {
			health[k] = v
		}
	}
	return out, health
}

// Sample appends one point to every pool's history: its desired and
// ready counts at now.
func (s *Store) Sample(now time.Time) {
	s.mu.Lock()
	for name, p := range s.pools {
		smp := Sample{At: now, Ready: p.states[events.ProxyReady]}
		if p.pool != nil {
			smp.Desired = p.pool.Size
		}
		if len(p.history) >= HistoryLen {
			p.history = append(p.history[:0], p.history[1:]...)
		}
		p.history = append(p.history, smp)
		s.changed(name)
	}
	s.mu.Unlock()
}
