package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/services/gateway/internal/route"
)

// Sessions are shared through the fleet-gateway-sessions bucket, one key
// "<pool>.<session id>" per session, so that every gateway serves a
// session on the same proxy and a restarted gateway keeps serving it
// there:
//
//   - a gateway that pins a session or moves it (its proxy left, failed,
//     or the session is due for rotation) writes it at once, without the
//     request waiting for the write;
//   - a use only counts in the table; the uses made since the last write
//     are written together at the next flush ([sessionFlush]), so a busy
//     session costs one write per flush, not one per request; without
//     maxRequests only a use a quarter of the TTL after the last write is
//     (see [route.SessionHook]), to renew the others' copy;
//   - every gateway watches the bucket and applies what the others write
//     ([route.Table.ApplySession]): for the same pin the uses add up, of
//     two pins the later wins, so gateways that moved a session at once
//     end on one proxy; a restarted gateway loads the bucket before it
//     serves.
//
// The tradeoff: no write is compare-and-set, and none is waited for. Two
// gateways that flush the same session's uses at once overwrite one
// another's, so across gateways a session may overrun maxRequests by the
// uses of about one flush; two that move a session at once serve it
// apart for the moment the writes take to cross. A write lost to a crash
// only means the session is pinned afresh.
//
// Each value carries the session's last use; a gateway forgets a session
// a session TTL after it, as the table does its own, and the entry
// expires from the bucket then: each write carries a message TTL of the
// rest of the session's life (Nats-TTL; the bucket allows message TTLs,
// and its limit markers tell the watchers). KeyValue.Put takes no TTL
// (jetstream.KeyTTL is Create's alone, and a session is written again and
// again), so a write is a publish to the key's subject, which is what Put
// does, with the TTL. A bucket-wide MaxAge could not follow each pool's
// own sessionTTL.
const (
	// sessionFlush is how often used sessions are written.
	sessionFlush = time.Second
	// sessionQueue bounds the sessions waiting to be written; a change
	// past it is not shared (the session stays served here).
	sessionQueue = 65536
	// sessionWriteTimeout bounds one flush's wait for its writes.
	sessionWriteTimeout = 5 * time.Second
	// sessionOpenTimeout bounds each attempt to open the bucket,
	// sessionLoadTimeout the wait for its sessions before serving.
	sessionOpenTimeout = 2 * time.Second
	sessionLoadTimeout = 5 * time.Second
)

// sessionValue is a fleet-gateway-sessions value.
type sessionValue struct {
	Pool   string    `json:"pool"`
	ID     string    `json:"id"`
	Proxy  string    `json:"proxy"`
	Pinned time.Time `json:"pinned"`
	Used   time.Time `json:"used"`
	Uses   int       `json:"uses"`
	// Gateway wrote it.
	Gateway string `json:"gateway"`
}

type sessionKey struct{ pool, id string }

// sessions shares the table's sessions with the other gateways.
type sessions struct {
	table   *route.Table
	gateway string
	log     *slog.Logger
	flush   time.Duration

	mu sync.Mutex
	// dirty holds the sessions to write, true for a pin or move (written
	// at once), false for uses (written at the next flush).
	dirty   map[sessionKey]bool
	dropped int
	// moved is signalled when a pin or move waits to be written.
	moved chan struct{}
}

func newSessions(table *route.Table, gateway string, log *slog.Logger) *sessions {
	s := &sessions{table: table, gateway: gateway, log: log, flush: sessionFlush,
		dirty: map[sessionKey]bool{}, moved: make(chan struct{}, 1)}
	table.SetSessionHook(s.changed)
	return s
}

// changed is the table's [route.SessionHook]: it queues the session to be
// written, without blocking.
func (s *sessions) changed(pool, id string, moved bool) {
	k := sessionKey{pool, id}
	s.mu.Lock()
	was, queued := s.dirty[k]
	if !queued && len(s.dirty) >= sessionQueue {
		s.dropped++
		s.mu.Unlock()
		return
	}
	s.dirty[k] = was || moved
	s.mu.Unlock()
	if moved {
		select {
		case s.moved <- struct{}{}:
		default:
		}
	}
}

// run opens the bucket, loads and follows it, and writes the sessions
// that changed here, until ctx ends. synced is called once the bucket's
// sessions are loaded, or once the bucket cannot be opened: the gateway
// then serves with sessions of its own while run keeps trying.
func (s *sessions) run(ctx context.Context, js jetstream.JetStream, synced func()) {
	var once sync.Once
	ready := func() { once.Do(synced) }
	defer ready()
	delay := time.Second
	var kv jetstream.KeyValue
	for {
		// A gateway the servers do not let near the bucket waits at most
		// sessionOpenTimeout for the answer before it serves.
		octx, cancel := context.WithTimeout(ctx, sessionOpenTimeout)
		var err error
		kv, err = js.KeyValue(octx, bus.BucketGatewaySessions)
		cancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		s.log.Warn("sessions are not shared with other gateways: the bucket does not open (create it with the bootstrap; the gateway needs to watch it and publish to its keys); trying again",
			"bucket", bus.BucketGatewaySessions, "err", err, "in", delay.String())
		ready()
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 30*time.Second)
	}
	// A watch the servers refuse may neither fail nor load: the gateway
	// serves after sessionLoadTimeout all the same.
	loading := time.AfterFunc(sessionLoadTimeout, func() {
		once.Do(func() {
			s.log.Warn("the shared sessions did not load in time; serving, and applying them as they come", "bucket", bus.BucketGatewaySessions, "after", sessionLoadTimeout.String())
			synced()
		})
	})
	defer loading.Stop()
	var wg sync.WaitGroup
	wg.Go(func() { s.follow(ctx, kv, ready) })
	s.write(ctx, js)
	wg.Wait()
}

// follow applies every session of the bucket to the table, watching again
// after a failure; ready is called after the first load.
func (s *sessions) follow(ctx context.Context, kv jetstream.KeyValue, ready func()) {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		w, err := kv.WatchAll(ctx)
		if err == nil {
			delay = 100 * time.Millisecond
			err = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
				if e == nil {
					ready()
					return
				}
				s.apply(e)
			})
			bus.StopWatch(w)
		}
		if ctx.Err() != nil {
			return
		}
		// Serve without the others' sessions rather than not at all.
		ready()
		s.log.Warn("watch failed; watching again", "bucket", bus.BucketGatewaySessions, "err", err, "in", delay.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// apply applies one entry. A deleted or expired entry changes nothing: a
// session expires in each table by its own last use.
func (s *sessions) apply(e jetstream.KeyValueEntry) {
	if deleted(e) {
		return
	}
	var v sessionValue
	if err := json.Unmarshal(e.Value(), &v); err != nil || v.Pool == "" || v.ID == "" || v.Proxy == "" || e.Key() != v.Pool+"."+v.ID {
		s.log.Warn("a shared session does not decode; ignored", "bucket", bus.BucketGatewaySessions, "key", e.Key())
		return
	}
	s.table.ApplySession(v.Pool, v.ID, route.SessionState{Proxy: v.Proxy, Pinned: v.Pinned, Used: v.Used, Uses: v.Uses})
}

// write writes pins and moves as they come and uses every flush, until ctx
// ends; then it writes what waits, briefly.
func (s *sessions) write(ctx context.Context, js jetstream.JetStream) {
	t := time.NewTicker(s.flush)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			last, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			s.writeDirty(last, js, true)
			cancel()
			return
		case <-s.moved:
			s.writeDirty(ctx, js, false)
		case <-t.C:
			s.writeDirty(ctx, js, true)
		}
	}
}

// writeDirty writes the queued pins and moves, and the used sessions too
// when all.
func (s *sessions) writeDirty(ctx context.Context, js jetstream.JetStream, all bool) {
	s.mu.Lock()
	var keys []sessionKey
	for k, moved := range s.dirty {
		if all || moved {
			keys = append(keys, k)
			delete(s.dirty, k)
		}
	}
	dropped := s.dropped
	s.dropped = 0
	s.mu.Unlock()
	if dropped > 0 {
		s.log.Warn("too many session changes waiting to be written; these stay on this gateway until their next change", "dropped", dropped)
	}
	var acks []jetstream.PubAckFuture
	now := time.Now()
	for _, k := range keys {
		st, ok := s.table.TakeSession(k.pool, k.id)
		if !ok {
			continue // forgotten here since: it expires from the bucket on its own
		}
		b, _ := json.Marshal(sessionValue{Pool: k.pool, ID: k.id, Proxy: st.Proxy, Pinned: st.Pinned.UTC(), Used: st.Used.UTC(), Uses: st.Uses, Gateway: s.gateway})
		msg := &nats.Msg{Subject: "$KV." + bus.BucketGatewaySessions + "." + k.pool + "." + k.id, Data: b}
		ack, err := js.PublishMsgAsync(msg, jetstream.WithMsgTTL(sessionTTL(st.Used, s.table.Spec(k.pool).SessionTTLOrDefault(), now)))
		if err != nil {
			s.log.Warn("write a session", "pool", k.pool, "err", err)
			continue
		}
		acks = append(acks, ack)
	}
	deadline := time.NewTimer(sessionWriteTimeout)
	defer deadline.Stop()
	failed := 0
	var lastErr error
	for _, a := range acks {
		select {
		case <-a.Ok():
		case err := <-a.Err():
			failed++
			lastErr = err
		case <-deadline.C:
			failed++
			lastErr = errors.New("no acknowledgement in time")
		case <-ctx.Done():
			return
		}
	}
	if failed > 0 {
		s.log.Warn("sessions not written; other gateways pin them afresh at their next use", "bucket", bus.BucketGatewaySessions, "failed", failed, "err", lastErr)
	}
}

// sessionTTL is the bucket TTL of a session last used at used: the rest
// of its life, whole seconds rounded up (a message TTL's unit), at least
// one.
func sessionTTL(used time.Time, ttl time.Duration, now time.Time) time.Duration {
	left := used.Add(ttl).Sub(now)
	return time.Duration(max(1, math.Ceil(left.Seconds()))) * time.Second
}
