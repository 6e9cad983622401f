package probe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
)

// Splitting the probing between health replicas.
//
// Each replica keeps a key named by its replica id in the fleet-health
// bucket, whose keys expire after bus.HealthMemberTTL, and renews it every
// beat. Every beat it also lists the bucket's keys: the live members. Each
// proxy belongs to one member, the same for every replica that sees the same
// members: the one with the highest rendezvous score of (member, proxy id).
// A replica probes only its own proxies. When a member leaves, only its
// proxies move, spread over the others; when one joins, it takes about 1/N
// of every other member's proxies.
//
// A replica that leaves cleanly deletes its key; one that dies stops
// renewing it, the server expires it after the TTL and the others take its
// proxies at their next beat: within TTL + beat of its last renewal.
//
// Transitions: a replica joining waits one beat after announcing itself, so
// the others have dropped its share before it starts; a replica that cannot
// renew its key for TTL − beat stops probing, before the others can have
// taken its share; a result of a probe of a proxy the replica no longer
// owns is dropped. Two replicas probing one proxy at once is still possible
// in a short window (a replica paused longer than the TTL, then resumed,
// acts on its old view until its next beat, at most one beat); it is
// harmless: probe records are whole-value puts (the last one wins, each
// true when taken), and ready/unhealthy events carry a message id derived
// from the proxy, the kind and the view's sequence, so the second append of
// the same transition is dropped by the stream's duplicate window.

// DefaultBeat is how often a replica renews its membership and reads the
// members, when [Config.Beat] is zero.
const DefaultBeat = time.Second

// replicaID is what a replica id may hold: a KV key of one token or more.
var replicaID = regexp.MustCompile(`^[A-Za-z0-9_=-]+(\.[A-Za-z0-9_=-]+)*$`)

// CheckReplica reports whether id can name a health replica.
func CheckReplica(id string) error {
	if len(id) > 128 || !replicaID.MatchString(id) {
		return fmt.Errorf("replica id %q: want 1 to 128 letters, digits, '-', '_', '=' or inner dots", id)
	}
	return nil
}

// owner returns the member that probes proxy id: the one with the highest
// rendezvous score. members must be sorted (ties go to the first); none
// owns nothing.
func owner(id string, members []string) string {
	best, bestScore := "", uint64(0)
	for _, m := range members {
		if s := score(m, id); best == "" || s > bestScore {
			best, bestScore = m, s
		}
	}
	return best
}

// score is the rendezvous weight of member for id: FNV-1a of both, mixed by
// the splitmix64 finalizer so that close inputs give unrelated weights.
func score(member, id string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(member))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(id))
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// memberValue is the value of a replica's key: for operators.
type memberValue struct {
	Replica string    `json:"replica"`
	Started time.Time `json:"started"`
	Proxies int       `json:"proxies"` // proxies it probes
}

// membership is one replica's view of the members.
type membership struct {
	kv      jetstream.KeyValue
	self    string
	beat    time.Duration
	ttl     time.Duration
	started time.Time
	log     *slog.Logger

	// Used by renew only, which runs on one goroutine at a time.
	rev    uint64    // revision of this replica's last write of its key
	warned time.Time // when a clash of replica ids was last logged

	mu      sync.Mutex
	members []string  // sorted, self among them; nil while not a member
	renewed time.Time // last successful renewal followed by a listing
}

// renew puts the replica's key, then reads the members. It returns whether
// they changed.
func (m *membership) renew(ctx context.Context, proxies int) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, m.ttl)
	defer cancel()
	at := time.Now()
	body, _ := json.Marshal(memberValue{Replica: m.self, Started: m.started, Proxies: proxies})
	// An update expecting this replica's last write reveals another
	// process renewing the same key: two replicas with one id.
	var rev uint64
	var err error
	if m.rev != 0 {
		rev, err = m.kv.Update(ctx, m.self, body, m.rev)
		if err != nil {
			if e, gerr := m.kv.Get(ctx, m.self); gerr == nil && e.Revision() != m.rev && time.Since(m.warned) > time.Minute {
				m.warned = time.Now()
				m.log.Error("another process renews this replica's key in "+bus.BucketHealth+": both probe the same proxies; give each replica its own --replica-id", "replica", m.self)
			}
			rev, err = m.kv.Put(ctx, m.self, body)
		}
	} else {
		rev, err = m.kv.Put(ctx, m.self, body)
	}
	if err != nil {
		return m.lapse(at), fmt.Errorf("renew membership in %s: %w", bus.BucketHealth, err)
	}
	m.rev = rev
	members, err := m.kv.Keys(ctx)
	if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
		return m.lapse(at), fmt.Errorf("list %s: %w", bus.BucketHealth, err)
	}
	if !slices.Contains(members, m.self) {
		// Expired between the put and the listing (a pause): the next
		// beat puts it again.
		members = append(members, m.self)
	}
	// A listing can miss a live key: its end can come early while other
	// keys are being written ([bus.Held]), and every member rewrites its
	// key each beat. So a member the last listing had and this one lacks
	// is read directly before it counts as gone: a key that expired or
	// was deleted reads as not held.
	for _, was := range m.list() {
		if slices.Contains(members, was) {
			continue
		}
		held, err := bus.Held(ctx, m.kv, was)
		if err != nil {
			return m.lapse(at), fmt.Errorf("read member %s in %s: %w", was, bus.BucketHealth, err)
		}
		if held {
			members = append(members, was)
		}
	}
	slices.Sort(members)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.renewed = at
	changed := !slices.Equal(members, m.members)
	m.members = members
	return changed, nil
}

// lapse handles a failed renewal: once the replica's key may be about to
// expire (TTL − beat after the last renewal), it stops being a member, so
// it probes nothing the others may be taking over. It returns whether the
// members changed.
func (m *membership) lapse(now time.Time) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.members == nil || now.Sub(m.renewed) < m.ttl-m.beat {
		return false
	}
	m.members = nil
	return true
}

// owns reports whether this replica probes proxy id.
func (m *membership) owns(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.members != nil && owner(id, m.members) == m.self
}

// current reports whether the view is recent enough to act on: renewed
// within the TTL, so no other replica can have taken this one's proxies.
func (m *membership) current() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.members != nil && time.Since(m.renewed) < m.ttl
}

func (m *membership) list() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.members)
}

// leave deletes the replica's key so that the others take its proxies at
// their next beat.
func (m *membership) leave() error {
	ctx, cancel := context.WithTimeout(context.Background(), m.ttl)
	defer cancel()
	if err := m.kv.Delete(ctx, m.self); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("leave %s: %w", bus.BucketHealth, err)
	}
	return nil
}

// ownsLocked reports whether this replica probes proxy id. Caller holds
// p.mu.
func (p *Prober) ownsLocked(id string) bool {
	return p.shard == nil || p.shard.owns(id)
}

// join makes the replica a member. When others are there already, it waits
// one beat before probing: they see it at their next beat and stop probing
// its share, so the handover does not probe a proxy twice.
func (p *Prober) join(ctx context.Context) error {
	kv, err := p.conn.JS.KeyValue(ctx, bus.BucketHealth)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return fmt.Errorf("bucket %s, where health replicas split the probing, does not exist (%w): %s", bus.BucketHealth, err, bus.BootstrapHint)
	}
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketHealth, err)
	}
	p.shard.kv = kv
	if _, err := p.shard.renew(ctx, 0); err != nil {
		return err
	}
	if members := p.shard.list(); len(members) > 1 {
		p.log.Info("joining the health replicas; waiting one beat for them to hand over", "members", members)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(p.cfg.Beat):
		}
		if _, err := p.shard.renew(ctx, 0); err != nil {
			return err
		}
	}
	p.log.Info("health replica joined", "members", p.shard.list())
	return nil
}

// beat renews the membership every beat until ctx ends, and moves proxies
// in or out of the schedule when the members change.
func (p *Prober) beat(ctx context.Context) {
	t := time.NewTicker(p.cfg.Beat)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		changed, err := p.shard.renew(ctx, p.owned())
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil && !failing:
			failing = true
			p.log.Warn("membership renewal failed; this replica stops probing if it lasts", "err", err, "after", (p.shard.ttl - p.shard.beat).String())
		case err == nil && failing:
			failing = false
			p.log.Info("membership renewed again")
		}
		if changed {
			gained, lost := p.reassign()
			p.log.Info("health replicas changed", "members", p.shard.list(), "gained", gained, "lost", lost, "probing", p.owned())
		}
	}
}

// reassign brings the schedule in line with the members: it schedules the
// proxies this replica now owns, probed first within half a beat (they were
// due already with their previous owner), and drops the ones it no longer
// owns.
func (p *Prober) reassign() (gained, lost int) {
	members := p.shard.list()
	within := min(p.cfg.Interval/4, p.cfg.Beat/2)
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, t := range p.proxies {
		own := members != nil && owner(id, members) == p.shard.self
		switch {
		case own && !t.owned:
			// Its streak and last success are those of the previous
			// owner's last record (see watchPeers).
			t.owned = true
			p.sched.add(id, now.Add(time.Duration(rand.Int64N(int64(within)+1))))
			gained++
		case !own && t.owned:
			// Its egress stays known: the new owner's records keep it
			// up to date (see watchPeers).
			t.owned = false
			p.sched.remove(id)
			lost++
		}
	}
	return gained, lost
}

// watchPeers follows fleet-probes for the proxies other replicas probe. The
// egress index learns their egress, so a proxy's sharedEgress counts the
// proxies sharing its egress IP across the whole fleet, not only among this
// replica's share (as current as the other replicas' records: one probe
// interval). And each such proxy's failure streak and last success are
// kept, so a replica taking a proxy over continues its streak: a failing
// proxy turns unhealthy after --unhealthy-after failed probes whichever
// replicas ran them.
func (p *Prober) watchPeers(ctx context.Context, kv jetstream.KeyValue) {
	for ctx.Err() == nil {
		w, err := kv.WatchAll(ctx)
		if err != nil {
			if ctx.Err() == nil {
				p.log.Warn("watch of the probe records failed; shared egress counts only this replica's proxies until it works", "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(p.cfg.Beat):
				}
			}
			continue
		}
		p.followPeers(ctx, w)
		bus.StopWatch(w)
		select {
		case <-ctx.Done():
		case <-time.After(p.cfg.Beat):
		}
	}
}

func (p *Prober) followPeers(ctx context.Context, w jetstream.KeyWatcher) {
	_ = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
		if e == nil {
			return
		}
		var r Record
		if e.Operation() == jetstream.KeyValuePut && json.Unmarshal(e.Value(), &r) != nil {
			return
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		// Only proxies this replica tracks and another probes; the
		// records of its own proxies are its own writes.
		if t := p.proxies[e.Key()]; t != nil && !t.owned && (r.Address == "" || r.Address == t.view.Address) {
			p.egress.set(e.Key(), r.EgressIP)
			t.streak, t.lastOK = r.Streak, time.Time{}
			if r.LastOKAt != nil {
				t.lastOK = *r.LastOKAt
			}
		}
	})
}

// owned counts the proxies this replica probes.
func (p *Prober) owned() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, t := range p.proxies {
		if t.owned {
			n++
		}
	}
	return n
}
