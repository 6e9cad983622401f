// Package clients authenticates the gateway's clients against an htpasswd
// file of bcrypt hashes (htpasswd -B): the user of each line is the pool
// the password opens, or "*" for every pool. The file is read again when
// it changes.
//
// bcrypt is slow on purpose, so what it costs is bounded: verdicts, right
// and wrong, are remembered for a few minutes in a bounded cache keyed by
// a keyed hash of the credentials (never the password itself), and a
// client address whose logins fail is throttled by a token bucket: past
// its burst, a login the cache cannot answer is refused unchecked
// ([Throttled]) until the bucket refills.
package clients

import (
	"container/list"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/htpasswd"
)

// remember is how long a verdict is kept without bcrypt.
const remember = 5 * time.Minute

// recheck is how often, at most, the file's modification time is read.
const recheck = time.Second

// maxClients bounds the client addresses whose failures are counted; the
// least recently seen is forgotten first.
const maxClients = 65536

// Defaults of [Limits].
const (
	DefaultFailureBurst = 10
	DefaultFailureEvery = time.Second
	DefaultCacheSize    = 10000
)

// Limits bounds what failed logins may cost. Zero values take the
// defaults.
type Limits struct {
	// FailureBurst is how many logins one client address may fail in a
	// row before it is throttled (default [DefaultFailureBurst]).
	FailureBurst int
	// FailureEvery is how often a throttled address gets one more try
	// (default [DefaultFailureEvery]).
	FailureEvery time.Duration
	// CacheSize bounds the verdicts remembered (default
	// [DefaultCacheSize]).
	CacheSize int
}

// Throttled refuses a login unchecked: its client address failed too
// many lately. It has the RetryAfter the gateway answers 429 with.
type Throttled struct {
	Client string
	After  time.Duration
}

func (e *Throttled) Error() string {
	return fmt.Sprintf("too many failed logins from %s; try again in %s", e.Client, e.After.Round(time.Second))
}

// RetryAfter is how long until the client may try again.
func (e *Throttled) RetryAfter() time.Duration { return e.After }

// File authenticates against one htpasswd file.
type File struct {
	path   string
	limits Limits
	// key makes the cache's keys a keyed hash, so what it holds is no
	// fast hash of a password.
	key []byte
	// verify checks a password against the file (htpasswd.Verify: one
	// bcrypt per matching line); tests count its calls.
	verify func(file []byte, user, password string) bool
	now    func() time.Time

	mu       sync.Mutex
	data     []byte
	mod      time.Time
	checked  time.Time
	verdicts *lru[[32]byte, verdict]
	buckets  *lru[string, bucket]
}

type verdict struct {
	ok    bool
	until time.Time
}

// bucket is a client address's failed-login budget: tokens at time at.
type bucket struct {
	tokens float64
	at     time.Time
}

// Load reads path and checks that every line is user:bcrypt-hash.
func Load(path string, limits Limits) (*File, error) {
	if limits.FailureBurst <= 0 {
		limits.FailureBurst = DefaultFailureBurst
	}
	if limits.FailureEvery <= 0 {
		limits.FailureEvery = DefaultFailureEvery
	}
	if limits.CacheSize <= 0 {
		limits.CacheSize = DefaultCacheSize
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	f := &File{
		path: path, limits: limits, key: key, verify: htpasswd.Verify, now: time.Now,
		verdicts: newLRU[[32]byte, verdict](limits.CacheSize),
		buckets:  newLRU[string, bucket](maxClients),
	}
	data, mod, err := read(path)
	if err != nil {
		return nil, err
	}
	f.data, f.mod, f.checked = data, mod, f.now()
	return f, nil
}

func read(path string) ([]byte, time.Time, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("clients file: %w", err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("clients file: %w", err)
	}
	n := 0
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok || user == "" || !strings.HasPrefix(hash, "$2") {
			return nil, time.Time{}, fmt.Errorf("clients file %s line %d: want <pool or *>:<bcrypt hash> (htpasswd -B)", path, i+1)
		}
		n++
	}
	if n == 0 {
		return nil, time.Time{}, errors.New("clients file " + path + ": no entries")
	}
	return data, st.ModTime(), nil
}

// Allow reports whether password opens pool for the client at address
// client: the file has a line for the pool, or for "*", with a bcrypt
// hash of it. A remembered verdict costs no bcrypt; otherwise the check
// takes one of client's failure tokens, given back when the password
// opens the pool, and without a token left Allow returns a [*Throttled]
// error, unchecked.
func (f *File) Allow(client, pool, password string) (bool, error) {
	now := f.now()
	mac := hmac.New(sha256.New, f.key)
	mac.Write([]byte(pool))
	mac.Write([]byte{0})
	mac.Write([]byte(password))
	var k [32]byte
	mac.Sum(k[:0])

	f.mu.Lock()
	f.reloadLocked(now)
	if v, ok := f.verdicts.get(k); ok && now.Before(v.until) {
		f.mu.Unlock()
		return v.ok, nil
	}
	if wait := f.takeLocked(client, now); wait > 0 {
		f.mu.Unlock()
		return false, &Throttled{Client: client, After: wait}
	}
	data, mod := f.data, f.mod
	f.mu.Unlock()

	ok := f.verify(data, pool, password) || f.verify(data, "*", password)

	f.mu.Lock()
	defer f.mu.Unlock()
	if ok {
		f.giveBackLocked(client)
	}
	// A verdict on a file replaced meanwhile is not kept.
	if f.mod.Equal(mod) {
		f.verdicts.put(k, verdict{ok: ok, until: now.Add(remember)})
	}
	return ok, nil
}

// reloadLocked reads the file again when it changed, forgetting the
// verdicts on the old one.
func (f *File) reloadLocked(now time.Time) {
	if now.Sub(f.checked) < recheck {
		return
	}
	f.checked = now
	if st, err := os.Stat(f.path); err == nil && !st.ModTime().Equal(f.mod) {
		if data, mod, err := read(f.path); err == nil {
			f.data, f.mod = data, mod
			f.verdicts.clear()
		}
	}
}

// takeLocked takes one of client's failure tokens; without one it
// returns how long until the next.
func (f *File) takeLocked(client string, now time.Time) time.Duration {
	b, ok := f.buckets.get(client)
	burst := float64(f.limits.FailureBurst)
	if !ok {
		b = bucket{tokens: burst, at: now}
	}
	if elapsed := now.Sub(b.at); elapsed > 0 {
		b.tokens = min(burst, b.tokens+float64(elapsed)/float64(f.limits.FailureEvery))
		b.at = now
	}
	if b.tokens < 1 {
		f.buckets.put(client, b)
		return time.Duration((1 - b.tokens) * float64(f.limits.FailureEvery))
	}
	b.tokens--
	f.buckets.put(client, b)
	return 0
}

// giveBackLocked returns the token a successful login took.
func (f *File) giveBackLocked(client string) {
	if b, ok := f.buckets.get(client); ok {
		b.tokens = min(float64(f.limits.FailureBurst), b.tokens+1)
		f.buckets.put(client, b)
	}
}

// lru is a map bounded to size entries that forgets the least recently
// used first.
type lru[K comparable, V any] struct {
	size  int
	order *list.List // of *lruEntry, most recent first
	items map[K]*list.Element
}

type lruEntry[K comparable, V any] struct {
	key K
	val V
}

func newLRU[K comparable, V any](size int) *lru[K, V] {
	return &lru[K, V]{size: size, order: list.New(), items: map[K]*list.Element{}}
}

func (l *lru[K, V]) get(k K) (V, bool) {
	e, ok := l.items[k]
	if !ok {
		var zero V
		return zero, false
	}
	l.order.MoveToFront(e)
	return e.Value.(*lruEntry[K, V]).val, true
}

func (l *lru[K, V]) put(k K, v V) {
	if e, ok := l.items[k]; ok {
		e.Value.(*lruEntry[K, V]).val = v
		l.order.MoveToFront(e)
		return
	}
	if l.order.Len() >= l.size {
		last := l.order.Back()
		delete(l.items, last.Value.(*lruEntry[K, V]).key)
		l.order.Remove(last)
	}
	l.items[k] = l.order.PushFront(&lruEntry[K, V]{key: k, val: v})
}

func (l *lru[K, V]) clear() {
	l.order.Init()
	clear(l.items)
}
