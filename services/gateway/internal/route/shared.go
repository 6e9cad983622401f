package route

import (
	"container/list"
	"time"
)

// SessionHook is told that session id of pool changed: moved is true when
// it was pinned or moved to a proxy, false when it was used. A use is
// told when its count matters (the pool rotates sessions after
// maxRequests) or when the other gateways last heard of the session a
// quarter of its TTL ago, so they do not forget it while it is used here. The
// caller that shares sessions with other gateways reads the change with
// [Table.TakeSession]. It is called without the table's locks held, on
// the request's path: it must not block.
type SessionHook func(pool, id string, moved bool)

// SetSessionHook has h told of session changes (nil: nobody is told).
func (t *Table) SetSessionHook(h SessionHook) {
	if h == nil {
		t.hook.Store(nil)
		return
	}
	t.hook.Store(&h)
}

func (t *Table) tell(pool, id string, moved bool) {
	if h := t.hook.Load(); h != nil {
		(*h)(pool, id, moved)
	}
}

// SessionState is a session as gateways share it.
type SessionState struct {
	// Proxy is the proxy the session is pinned to, since Pinned.
	Proxy  string
	Pinned time.Time
	// Used is the session's last use; it expires a session TTL after it.
	Used time.Time
	// Uses counts the session's uses since Pinned.
	Uses int
}

// TakeSession returns the state of a live session of pool, to share it;
// its uses count as known to the other gateways from then on (see
// [Table.ApplySession]). false when there is no such live session.
func (t *Table) TakeSession(pool, id string) (SessionState, bool) {
	return t.liveSession(pool, id, true)
}

// ApplySession records the state of a session another gateway shared (or
// this one, read back):
//
//   - a session past its TTL (by st.Used) is ignored;
//   - one this table does not hold is added, counting against no client
//     until a client here uses it, and against the pool's bound;
//   - for the pin this table holds (same proxy, same Pinned), the uses
//     are st's plus those made here since this table last shared it;
//   - of two different pins the later wins (ties: the greater proxy id),
//     so every gateway ends on one pin whatever order it learns them in;
//     when this table's pin wins, the hook is told it moved, so it is
//     shared again.
func (t *Table) ApplySession(pool, id string, st SessionState) {
	t.mu.Lock()
	p := t.poolLocked(pool)
	t.mu.Unlock()
	if t.applySession(p, id, st) {
		t.tell(pool, id, true)
	}
}

// applySession is ApplySession's part under p's lock; it reports whether
// this table's own pin won.
func (t *Table) applySession(p *pool, id string, st SessionState) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := t.now()
	if now.After(st.Used.Add(p.spec.SessionTTLOrDefault())) {
		return false
	}
	expireLocked(p, now)
	s := p.sessions[id]
	switch {
	case s == nil:
		if p.lru.Len() >= t.limits.SessionsPerPool {
			p.dropLocked(p.lru.Back().Value.(*session))
		}
		s = &session{id: id, proxy: st.Proxy, pinned: st.Pinned, used: st.Used, uses: st.Uses, synced: st.Uses, shared: now, remote: true}
		s.inPool = insertByUse(p.lru, s)
		p.sessions[id] = s
		return false
	case s.proxy == st.Proxy && s.pinned.Equal(st.Pinned):
		s.uses = st.Uses + max(s.uses-s.synced, 0)
		s.synced = st.Uses
		s.shared = now
	case st.Pinned.After(s.pinned) || st.Pinned.Equal(s.pinned) && st.Proxy > s.proxy:
		s.proxy, s.pinned, s.uses, s.synced, s.shared = st.Proxy, st.Pinned, st.Uses, st.Uses, now
	default:
		return true
	}
	if st.Used.After(s.used) {
		s.used = st.Used
		p.lru.Remove(s.inPool)
		s.inPool = insertByUse(p.lru, s)
		if s.inClient != nil {
			p.byClient[s.client].MoveToFront(s.inClient)
		}
	}
	return false
}

// insertByUse puts s into lru (most recently used first) where its last
// use places it, so expiry, which pops from the back, stays in order.
// What other gateways share is recent: the walk from the front is short.
func insertByUse(lru *list.List, s *session) *list.Element {
	for e := lru.Front(); e != nil; e = e.Next() {
		if !e.Value.(*session).used.After(s.used) {
			return lru.InsertBefore(s, e)
		}
	}
	return lru.PushBack(s)
}

// Session returns the state of a live session of pool, for reading
// ([Table.TakeSession] is the sharer's); false when there is none.
func (t *Table) Session(pool, id string) (SessionState, bool) {
	return t.liveSession(pool, id, false)
}

// liveSession returns the state of a live session of pool; with take, its
// uses count as shared from now on.
func (t *Table) liveSession(pool, id string, take bool) (SessionState, bool) {
	p := t.pool(pool)
	if p == nil {
		return SessionState{}, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[id]
	if s == nil || t.now().After(s.used.Add(p.spec.SessionTTLOrDefault())) {
		return SessionState{}, false
	}
	if take {
		s.synced = s.uses
		s.shared = t.now()
	}
	return SessionState{Proxy: s.proxy, Pinned: s.pinned, Used: s.used, Uses: s.uses}, true
}
