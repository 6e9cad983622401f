package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// KV protocol details the projection reads and writes directly: a batch
// of keys is read with one direct get and written with pipelined publishes,
// which the KeyValue API does one round trip at a time.
const (
	kvOperationHeader = "KV-Operation"
	kvDelete          = "DEL"
	kvPurge           = "PURGE"

	directGetPrefix = "$JS.API.DIRECT.GET."
	msgGetPrefix    = "$JS.API.STREAM.MSG.GET."
	upToSeqHeader   = "Nats-UpTo-Sequence"
	statusHeader    = "Status"
	numPendingHdr   = "Nats-Num-Pending"

	// multiGetLimit is how many keys one direct get asks for; the server
	// answers at most 1024 messages per request.
	multiGetLimit = 1024
	// readTimeout bounds one batched read.
	readTimeout = 10 * time.Second
	// behindFirstWait and behindMaxWait space the reads asked again of a
	// replica that answered from behind the bucket's last sequence.
	behindFirstWait = 5 * time.Millisecond
	behindMaxWait   = 200 * time.Millisecond
	// maxMarkers bounds the delete markers a complete cache remembers (see
	// [bucket.complete]); past it they are forgotten and read when needed.
	maxMarkers = 1 << 16
)

// key is what the projection knows of one key of a view bucket.
type key[T any] struct {
	// rev is the stream sequence of the key's last entry (0: none): the
	// expectation the next write of the key is made under.
	rev uint64
	val T
	// exists: val is the key's value. A value that does not decode counts
	// as absent, so the next creating event replaces it.
	exists bool
	// ended: the key's last entry is a delete marker.
	ended bool
}

// bucket caches the keys of one view bucket between batches.
//
// The projection is the only writer of its buckets, so what it wrote is
// what the bucket holds, as long as nobody else wrote since: before each
// batch [bucket.check] compares the bucket's stream with the state the
// projection left it in and forgets everything when they differ (another
// health instance finished a batch, the bucket was dropped). Every write
// also expects the revision it was computed from, so a write racing
// another writer fails instead of overwriting.
type bucket[T any] struct {
	name string
	// direct is the subject of the bucket's direct gets.
	direct string
	stream jetstream.Stream // KV_<name>, bound on first use
	keys   map[string]*key[T]
	// complete: every key the bucket holds, and every delete marker, is in
	// keys, so a key not in keys has never been written. True when the
	// cache started from an empty bucket (a rebuild, a new fleet).
	complete bool
	markers  int // keys with ended set
	// fresh are the keys loaded for the batch being applied.
	fresh []string
	// created and last identify the bucket's stream and its last sequence
	// as the projection left them; created is zero when nothing is known.
	created time.Time
	last    uint64
	// lo, hi and n are the lowest and highest revision, and the number, of
	// the writes of the batch being applied.
	lo, hi, n uint64
	log       *slog.Logger
}

func newBucket[T any](name string, log *slog.Logger) *bucket[T] {
	return &bucket[T]{name: name, direct: directGetPrefix + "KV_" + name, log: log.With("bucket", name)}
}

// forget drops everything cached; the next [bucket.check] starts over.
func (b *bucket[T]) forget() {
	b.keys, b.complete, b.markers, b.created, b.last, b.fresh = nil, false, 0, time.Time{}, 0, nil
	b.lo, b.hi, b.n = 0, 0, 0
}

// check keeps the cache if the bucket's stream is where the projection
// left it, and starts it over otherwise.
func (b *bucket[T]) check(ctx context.Context, js jetstream.JetStream) error {
	if b.stream == nil {
		st, err := js.Stream(ctx, "KV_"+b.name)
		if err != nil {
			return fmt.Errorf("bucket %s: %w", b.name, err)
		}
		b.stream = st
	}
	info, err := b.stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", b.name, err)
	}
	if b.keys != nil && info.Created.Equal(b.created) && info.State.LastSeq == b.last {
		return nil
	}
	b.keys, b.markers = map[string]*key[T]{}, 0
	b.complete = info.State.Msgs == 0
	b.created, b.last = info.Created, info.State.LastSeq
	b.lo, b.hi, b.n = 0, 0, 0
	return nil
}

// subject is the KV subject of key k.
func (b *bucket[T]) subject(k string) string { return "$KV." + b.name + "." + k }

// load makes sure every key of ks is cached, reading the missing ones with
// batched direct gets.
func (b *bucket[T]) load(ctx context.Context, nc *nats.Conn, ks map[string]struct{}) error {
	var missing []string
	for k := range ks {
		if _, ok := b.keys[k]; !ok {
			b.fresh = append(b.fresh, k)
			if b.complete {
				b.keys[k] = &key[T]{}
				continue
			}
			missing = append(missing, k)
		}
	}
	for len(missing) > 0 {
		n := min(len(missing), multiGetLimit)
		if err := b.read(ctx, nc, missing[:n]); err != nil {
			return fmt.Errorf("read bucket %s: %w", b.name, err)
		}
		missing = missing[n:]
	}
	return nil
}

// read fetches the last entry of each key of ks in one direct get
// ("multi_last"), and caches every key, found or not. The server stops at
// its byte limit, saying how many entries it left; those are asked again.
//
// Any replica of the bucket answers a direct get, and a follower serves
// them from what it has applied: one that has just come back from a
// partition, or has not applied the last writes yet, answers from behind.
// Its "not found" would make an event that only changes an existing key
// look like one for a key never written, and be dropped. So an answer
// counts only when it proves the replica holds the bucket's last sequence
// as [bucket.check] saw it: the end-of-batch mark carries the sequence
// the replica read up to. An answer without that mark (none of the keys
// found) proves nothing; the request then also names the bucket's last
// key, read from the stream's leader, which a replica that is current
// holds (or a key the cache holds a value of, when it has one). An answer
// from behind is discarded, and asked again shortly.
func (b *bucket[T]) read(ctx context.Context, nc *nats.Conn, ks []string) error {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	want := map[string]bool{}
	for _, k := range ks {
		want[k] = true
	}
	sentinel := b.liveKey(want)
	wait := behindFirstWait
	for len(want) > 0 {
		subjects := make([]string, 0, len(want)+1)
		for k := range want {
			subjects = append(subjects, b.subject(k))
		}
		if sentinel != "" && !want[sentinel] {
			subjects = append(subjects, b.subject(sentinel))
		}
		req, err := json.Marshal(struct {
			MultiLast []string `json:"multi_last"`
		}{subjects})
		if err != nil {
			return err
		}
		inbox := nc.NewInbox()
		sub, err := nc.SubscribeSync(inbox)
		if err != nil {
			return err
		}
		ans, err := b.collect(ctx, nc, sub, inbox, req, want, sentinel)
		_ = sub.Unsubscribe()
		if err != nil {
			return err
		}
		if !ans.ended || ans.upTo < b.last {
			if !ans.ended && sentinel == "" {
				k, ok, err := b.lastKey(ctx, nc)
				if err != nil {
					return err
				}
				if !ok {
					break // the bucket holds no entry: none of ks was written
				}
				sentinel = k
				continue
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("direct get of %d keys: the replica answering is behind the bucket's last sequence %d (read up to %d)", len(want), b.last, ans.upTo)
			case <-t.C:
			}
			wait = min(2*wait, behindMaxWait)
			continue
		}
		left := len(want)
		for _, e := range ans.entries {
			delete(want, e.k)
			b.cache(e.k, e.rev, e.op, e.data)
		}
		if !ans.more {
			break
		}
		if len(want) == left {
			return fmt.Errorf("direct get of %d keys returned none and said more were left", left)
		}
	}
	for k := range want {
		b.keys[k] = &key[T]{} // never written
	}
	return nil
}

// liveKey is a key the cache holds a value of, outside want, "" if none:
// the bucket holds it (nobody else wrote since the cache was checked), so
// a replica that is current answers it and the answer proves its
// sequence, whether or not the keys of want were ever written.
func (b *bucket[T]) liveKey(want map[string]bool) string {
	for k, c := range b.keys {
		if c.exists && !want[k] {
			return k
		}
	}
	return ""
}

// entry is one key's last entry as a direct get answered it.
type entry struct {
	k, op string
	rev   uint64
	data  []byte
}

// answer is one direct get's answer.
type answer struct {
	entries []entry
	// ended: the answer ended with its end-of-batch mark, which says
	// whether entries were left out (more) and the sequence the replica
	// read up to (upTo). An answer that found none of the keys has no
	// such mark.
	ended bool
	more  bool
	upTo  uint64
}

// collect sends one direct get and gathers its answers for the keys of
// want and for sentinel (which is only read, not returned).
func (b *bucket[T]) collect(ctx context.Context, nc *nats.Conn, sub *nats.Subscription, inbox string, req []byte, want map[string]bool, sentinel string) (answer, error) {
	var ans answer
	if err := nc.PublishRequest(b.direct, inbox, req); err != nil {
		return ans, err
	}
	prefix := b.subject("")
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return ans, err
		}
		switch status := m.Header.Get(statusHeader); status {
		case "":
		case "204": // end of batch
			np, _ := strconv.ParseUint(m.Header.Get(numPendingHdr), 10, 64)
			upTo, err := strconv.ParseUint(m.Header.Get(upToSeqHeader), 10, 64)
			if err != nil {
				return ans, fmt.Errorf("direct get: end of batch without the sequence read up to: %w", err)
			}
			ans.ended, ans.more, ans.upTo = true, np > 0, upTo
			return ans, nil
		case "404": // none of the keys has an entry
			return ans, nil
		default:
			return ans, fmt.Errorf("direct get: status %s %s", status, m.Header.Get("Description"))
		}
		k, ok := strings.CutPrefix(m.Header.Get(jetstream.SubjectHeader), prefix)
		if !ok || (!want[k] && k != sentinel) {
			return ans, fmt.Errorf("direct get answered for %q", m.Header.Get(jetstream.SubjectHeader))
		}
		if !want[k] {
			continue // the sentinel only makes the answer prove its sequence
		}
		rev, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
		if err != nil {
			return ans, fmt.Errorf("direct get: sequence of %s: %w", k, err)
		}
		ans.entries = append(ans.entries, entry{k: k, op: m.Header.Get(kvOperationHeader), rev: rev, data: m.Data})
	}
}

// lastKey asks the bucket's stream leader (a message get, which only the
// leader answers) for the key of the bucket's last entry; ok is false
// when the bucket holds none.
func (b *bucket[T]) lastKey(ctx context.Context, nc *nats.Conn) (k string, ok bool, err error) {
	req, err := json.Marshal(struct {
		LastBySubject string `json:"last_by_subj"`
	}{b.subject(">")})
	if err != nil {
		return "", false, err
	}
	reply, err := nc.RequestWithContext(ctx, msgGetPrefix+"KV_"+b.name, req)
	if err != nil {
		return "", false, fmt.Errorf("bucket %s: last entry: %w", b.name, err)
	}
	var resp struct {
		Error *struct {
			Code        int    `json:"code"`
			ErrCode     int    `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
		Message *struct {
			Subject string `json:"subject"`
		} `json:"message"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return "", false, fmt.Errorf("bucket %s: last entry: %w", b.name, err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrCode == int(jetstream.JSErrCodeMessageNotFound):
		return "", false, nil
	case resp.Error != nil:
		return "", false, fmt.Errorf("bucket %s: last entry: %d %s", b.name, resp.Error.Code, resp.Error.Description)
	case resp.Message == nil:
		return "", false, fmt.Errorf("bucket %s: last entry: an answer without a message", b.name)
	}
	k, ok = strings.CutPrefix(resp.Message.Subject, b.subject(""))
	if !ok {
		return "", false, fmt.Errorf("bucket %s: last entry on %q", b.name, resp.Message.Subject)
	}
	return k, true, nil
}

// cache records the entry at rev of key k.
func (b *bucket[T]) cache(k string, rev uint64, op string, data []byte) {
	e := &key[T]{rev: rev}
	switch op {
	case kvDelete, kvPurge:
		e.ended = true
		b.markers++
	default:
		if err := json.Unmarshal(data, &e.val); err != nil {
			b.log.Error("stored view value does not decode; treating it as absent", "key", k, "err", err)
			var zero T
			e.val = zero
		} else {
			e.exists = true
		}
	}
	b.keys[k] = e
}

// slot is one key while a batch is folded into it.
type slot[T any] struct {
	key[T]
	base  uint64 // the revision read: the write expects it
	dirty bool
	// wave orders the batch's writes: every write of a wave is durable
	// before the next wave starts (see fold.noteReplacement).
	wave int
	// noterWave is the wave of the last proxy of this batch recorded as
	// this one's replacement, -1 if none.
	noterWave int
}

// slot returns the batch's slot of key k, which must be cached.
func (b *bucket[T]) slot(slots map[string]*slot[T], k string) *slot[T] {
	if s, ok := slots[k]; ok {
		return s
	}
	c := b.keys[k]
	if c == nil {
		// Not loaded: the caller gathers every key before folding.
		panic("projection: key " + k + " of bucket " + b.name + " was not loaded")
	}
	s := &slot[T]{key: *c, base: c.rev, noterWave: -1}
	slots[k] = s
	return s
}

// put sets the slot's value.
func (s *slot[T]) put(v T) {
	s.val, s.exists, s.ended, s.dirty = v, true, false, true
}

// del removes the slot's key, leaving a delete marker.
func (s *slot[T]) del() {
	var zero T
	s.val, s.exists, s.ended, s.dirty = zero, false, true, true
}

// write is one pipelined KV write of a batch.
type write struct {
	bucket, key string
	fut         jetstream.PubAckFuture
	done        func(rev uint64) // records the new revision
}

// publish starts the writes of the dirty slots of wave w. crash, the test
// hook of [Projector], may drop writes: the others of the wave are made and
// publish returns errCrashed.
func publish[T any](js jetstream.JetStream, b *bucket[T], slots map[string]*slot[T], w int, out []write, crash func(int, string, string) bool) ([]write, error) {
	var crashed error
	for k, s := range slots {
		if !s.dirty || s.wave != w {
			continue
		}
		if crash != nil && crash(w, b.name, k) {
			crashed = errCrashed
			continue
		}
		m := nats.NewMsg(b.subject(k))
		if s.exists {
			data, err := json.Marshal(s.val)
			if err != nil {
				return out, err
			}
			m.Data = data
		} else {
			m.Header.Set(kvOperationHeader, kvDelete)
		}
		f, err := js.PublishMsgAsync(m, jetstream.WithExpectLastSequencePerSubject(s.base))
		if err != nil {
			return out, fmt.Errorf("write %s/%s: %w", b.name, k, err)
		}
		out = append(out, write{bucket: b.name, key: k, fut: f, done: func(rev uint64) {
			s.rev = rev
			if b.n == 0 || rev < b.lo {
				b.lo = rev
			}
			b.hi, b.n = max(b.hi, rev), b.n+1
		}})
	}
	return out, crashed
}

// await waits for the acknowledgement of every write and returns the first
// failure. A write refused because the key moved since it was read means
// another writer is at work.
func await(ctx context.Context, ws []write) error {
	var first error
	for _, w := range ws {
		select {
		case ack := <-w.fut.Ok():
			w.done(ack.Sequence)
		case err := <-w.fut.Err():
			if first == nil {
				first = fmt.Errorf("write %s/%s: %w", w.bucket, w.key, err)
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return first
}

// keep folds the batch's slots into the cache once they are durable, and
// bounds what the cache holds. Unless the batch's writes are the revisions
// right after the one [bucket.check] saw, somebody else wrote meanwhile,
// and the cache is dropped instead.
func (b *bucket[T]) keep(slots map[string]*slot[T]) {
	if b.n > 0 {
		lo, hi, n := b.lo, b.hi, b.n
		b.lo, b.hi, b.n = 0, 0, 0
		if lo != b.last+1 || hi-lo+1 != n {
			b.forget()
			return
		}
		b.last = hi
	}
	for k, s := range slots {
		c := b.keys[k]
		if c.ended {
			b.markers--
		}
		*c = s.key
		if c.ended {
			b.markers++
		}
	}
	fresh := b.fresh
	b.fresh = nil
	switch {
	case !b.complete:
		// Only the live keys are worth keeping: the others are read again
		// in the rare case they are needed.
		for _, k := range fresh {
			if c, ok := b.keys[k]; ok && !c.exists {
				delete(b.keys, k)
			}
		}
		for k := range slots {
			if c, ok := b.keys[k]; ok && !c.exists {
				delete(b.keys, k)
			}
		}
		b.markers = 0
	case b.markers > maxMarkers:
		for k, c := range b.keys {
			if !c.exists {
				delete(b.keys, k)
			}
		}
		b.markers, b.complete = 0, false
	}
}
