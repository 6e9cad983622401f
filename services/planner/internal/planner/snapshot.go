package planner

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// Snapshots.
//
// The projection is a pure function of FLEET_EVENTS, so any replica, leader
// or follower, may checkpoint it: the state together with the sequence it
// covers goes into the object store [bus.ObjectSnapshots] as the object
// "planner". A start loads that snapshot and replays only the events after
// its sequence. A snapshot is a cache of the log, never a source: when it
// is missing, unreadable, of another format version, or was taken from
// another stream (its sequence is beyond the stream's last one, or the
// event it names is not at its sequence), the replica replays the whole log
// and says so in a warning.
//
// An object store put is atomic: the chunks are stored first and the
// object's meta entry, naming them and their SHA-256 digest, last, so a
// writer that dies mid-put leaves the previous snapshot in place, and a
// reader verifies the digest before the state it decoded is used. One
// replica writes at a time: a writer first creates the key
// snapshotClaimKey in the lease bucket (whose entries expire on their own),
// so replicas that reach the threshold together do not race their puts.
//
// The object is a sequence of JSON values: a [snapHeader] naming the
// format version, the sequence and how many records follow, the pools, the
// proxies, and a [snapTrailer] with the rest of the state.

// snapshotObject is the name of the planner's snapshot object.
const snapshotObject = "planner"

// snapshotFormat and snapshotVersion identify the snapshot encoding. A
// change of the encoding or of what the fold keeps takes a new version;
// a snapshot of any other version is not loaded (the log is replayed).
const (
	snapshotFormat  = "proxyfleet.planner.snapshot"
	snapshotVersion = 5
)

// Object metadata keys: a reader checks them before it downloads the body.
const (
	metaVersion = "version"
	metaSeq     = "seq"
)

// snapshotClaimKey is the fleet-planner key a replica holds while it
// writes a snapshot.
const snapshotClaimKey = "snapshot-writer"

// anchor names one event: its stream sequence and its envelope id.
type anchor struct {
	Seq uint64 `json:"seq"`
	ID  string `json:"id"`
}

// snapHeader opens a snapshot.
type snapHeader struct {
	Format  string `json:"format"`
	Version int    `json:"version"`
	// Seq is the sequence of the last event the state holds.
	Seq uint64 `json:"seq"`
	// Anchor is the last event applied that stays in the stream.
	Anchor anchor `json:"anchor"`
	// Pools and Proxies count the records that follow.
	Pools   int `json:"pools"`
	Proxies int `json:"proxies"`
}

// snapPool is one pool record.
type snapPool struct {
	Name          string             `json:"name"`
	Spec          events.PoolSpec    `json:"spec"`
	Revision      int                `json:"revision"`
	SecretsDigest string             `json:"secretsDigest,omitempty"`
	Deleted       bool               `json:"deleted,omitempty"`
	LastSeq       uint64             `json:"lastSeq"`
	ShapeRevision int                `json:"shapeRevision"`
	Conditions    []events.Condition `json:"conditions,omitempty"`
	Autoscaled    int                `json:"autoscaled,omitempty"`
	ScaleReason   string             `json:"scaleReason,omitempty"`
	Shape         string             `json:"shape,omitempty"`
	Traceparent   string             `json:"traceparent,omitempty"`
	TraceSeq      uint64             `json:"traceSeq,omitempty"`
	Counts        map[string]int     `json:"counts,omitempty"`
}

// snapProxy is one proxy record.
type snapProxy struct {
	View          events.ProxyView          `json:"view"`
	LastSeq       uint64                    `json:"lastSeq"`
	DeleteAttempt int                       `json:"deleteAttempt,omitempty"`
	RetiringSince time.Time                 `json:"retiringSince,omitzero"`
	DeleteFailure string                    `json:"deleteFailure,omitempty"`
	Traceparent   string                    `json:"traceparent,omitempty"`
	Requested     events.ProxyRequestedData `json:"requested"`
}

// snapAvoid is one avoided target.
type snapAvoid struct {
	Class string    `json:"class"`
	At    time.Time `json:"at"`
}

// snapTrailer closes a snapshot.
type snapTrailer struct {
	Targets map[string][]string  `json:"targets"`
	Avoid   map[string]snapAvoid `json:"avoid"`
	// Finished lists the finished proxies among the records, in the order
	// they finished; Abandoned every proxy ever abandoned.
	Finished  []string `json:"finished"`
	Abandoned []string `json:"abandoned"`
	// End is always true: a snapshot without it is incomplete.
	End bool `json:"end"`
}

// image is a copy of the state taken under the planner's lock, encoded
// after it is released.
type image struct {
	header  snapHeader
	pools   []snapPool
	proxies []snapProxy
	trailer snapTrailer
}

// image copies the state. Callers hold the planner's lock.
func (s *state) image() *image {
	img := &image{
		header:  snapHeader{Format: snapshotFormat, Version: snapshotVersion, Seq: s.seq, Anchor: s.anchor},
		pools:   make([]snapPool, 0, len(s.pools)),
		proxies: make([]snapProxy, 0, len(s.proxies)),
		trailer: snapTrailer{Targets: map[string][]string{}, Avoid: map[string]snapAvoid{}, End: true},
	}
	for _, p := range s.pools {
		counts := make(map[string]int, len(p.counts))
		for k, n := range p.counts {
			counts[k] = n
		}
		img.pools = append(img.pools, snapPool{
			Name: p.Name, Spec: p.Spec, Revision: p.Revision, SecretsDigest: p.SecretsDigest, Deleted: p.Deleted,
			LastSeq: p.LastSeq, ShapeRevision: p.ShapeRevision, Conditions: append([]events.Condition(nil), p.Conditions...),
			Autoscaled: p.Autoscaled, ScaleReason: p.ScaleReason, Shape: p.shape, Traceparent: p.traceparent, TraceSeq: p.traceSeq, Counts: counts,
		})
	}
	for _, x := range s.proxies {
		img.proxies = append(img.proxies, snapProxy{View: x.ProxyView, LastSeq: x.LastSeq, DeleteAttempt: x.DeleteAttempt,
			RetiringSince: x.RetiringSince, DeleteFailure: x.DeleteFailure, Traceparent: x.traceparent, Requested: x.requested})
	}
	for entry, ts := range s.targets {
		list := make([]string, 0, len(ts))
		for t := range ts {
			list = append(list, t)
		}
		img.trailer.Targets[entry] = list
	}
	for k, a := range s.avoid {
		img.trailer.Avoid[k] = snapAvoid{Class: a.Class, At: a.At}
	}
	img.trailer.Finished = s.finished.list()
	img.trailer.Abandoned = make([]string, 0, len(s.abandoned))
	for id := range s.abandoned {
		img.trailer.Abandoned = append(img.trailer.Abandoned, id)
	}
	img.header.Pools, img.header.Proxies = len(img.pools), len(img.proxies)
	return img
}

// encode writes the image to w.
func (img *image) encode(w io.Writer) error {
	bw := bufio.NewWriterSize(w, 256<<10)
	enc := json.NewEncoder(bw)
	if err := enc.Encode(img.header); err != nil {
		return err
	}
	for i := range img.pools {
		if err := enc.Encode(&img.pools[i]); err != nil {
			return err
		}
	}
	for i := range img.proxies {
		if err := enc.Encode(&img.proxies[i]); err != nil {
			return err
		}
	}
	if err := enc.Encode(img.trailer); err != nil {
		return err
	}
	return bw.Flush()
}

// errSnapshotVersion marks a snapshot of a format version this planner does
// not read.
var errSnapshotVersion = errors.New("unknown snapshot format version")

// decodeSnapshot reads a snapshot into a new state keeping keep finished
// proxies. It reads r to its end, so a reader that verifies a digest at
// the end (an object store get) reports a mismatch before the state is
// used.
func decodeSnapshot(r io.Reader, log *slog.Logger, keep int) (*state, error) {
	dec := json.NewDecoder(bufio.NewReaderSize(r, 256<<10))
	var h snapHeader
	if err := dec.Decode(&h); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	if h.Format != snapshotFormat {
		return nil, fmt.Errorf("header: format %q, want %q", h.Format, snapshotFormat)
	}
	if h.Version != snapshotVersion {
		return nil, fmt.Errorf("%w %d (this planner reads version %d)", errSnapshotVersion, h.Version, snapshotVersion)
	}
	if h.Pools < 0 || h.Proxies < 0 {
		return nil, fmt.Errorf("header: negative record counts")
	}
	s := newState(log, keep)
	s.seq, s.anchor = h.Seq, h.Anchor
	for i := range h.Pools {
		var sp snapPool
		if err := dec.Decode(&sp); err != nil {
			return nil, fmt.Errorf("pool record %d: %w", i, err)
		}
		if _, dup := s.pools[sp.Name]; dup || sp.Name == "" {
			return nil, fmt.Errorf("pool record %d: name %q missing or repeated", i, sp.Name)
		}
		counts := sp.Counts
		if counts == nil {
			counts = map[string]int{}
		}
		s.pools[sp.Name] = &Pool{
			Pool: decide.Pool{Name: sp.Name, Spec: sp.Spec, Revision: sp.Revision, Deleted: sp.Deleted,
				LastSeq: sp.LastSeq, ShapeRevision: sp.ShapeRevision, Conditions: sp.Conditions,
				Autoscaled: sp.Autoscaled, ScaleReason: sp.ScaleReason},
			SecretsDigest: sp.SecretsDigest, shape: sp.Shape, traceparent: sp.Traceparent, traceSeq: sp.TraceSeq, counts: counts, members: map[string]*Proxy{}, onTarget: map[string]int{},
		}
	}
	for i := range h.Proxies {
		var sx snapProxy
		if err := dec.Decode(&sx); err != nil {
			return nil, fmt.Errorf("proxy record %d: %w", i, err)
		}
		id := sx.View.ID
		if _, dup := s.proxies[id]; dup || id == "" {
			return nil, fmt.Errorf("proxy record %d: id %q missing or repeated", i, id)
		}
		pl := s.pools[sx.View.Pool]
		if pl == nil {
			return nil, fmt.Errorf("proxy record %d: pool %q has no record", i, sx.View.Pool)
		}
		x := &Proxy{Proxy: decide.Proxy{ProxyView: sx.View, LastSeq: sx.LastSeq, DeleteAttempt: sx.DeleteAttempt,
			RetiringSince: sx.RetiringSince, DeleteFailure: sx.DeleteFailure},
			traceparent: sx.Traceparent, requested: sx.Requested}
		s.proxies[id] = x
		if !events.IsTerminal(x.State) {
			pl.members[id] = x
			s.move(pl, slot{}, slotOf(x))
		}
	}
	var t snapTrailer
	if err := dec.Decode(&t); err != nil {
		return nil, fmt.Errorf("trailer: %w", err)
	}
	if !t.End {
		return nil, errors.New("trailer: not marked as the end")
	}
	for entry, ts := range t.Targets {
		s.noteTarget(entry, "")
		for _, tg := range ts {
			s.noteTarget(entry, tg)
		}
	}
	for k, a := range t.Avoid {
		s.avoid[k] = decide.Avoidance{Class: a.Class, At: a.At}
	}
	for _, id := range t.Abandoned {
		s.abandoned[id] = struct{}{}
	}
	finished := 0
	for _, id := range t.Finished {
		x := s.proxies[id]
		if x == nil || !events.IsTerminal(x.State) {
			return nil, fmt.Errorf("trailer: finished proxy %q has no finished record", id)
		}
		s.finished.push(id)
		finished++
	}
	for _, x := range s.proxies {
		if events.IsTerminal(x.State) {
			finished--
		}
	}
	if finished != 0 {
		return nil, errors.New("trailer: the finished list does not name every finished record")
	}
	s.trimFinished()
	// Nothing may follow the trailer, and reading on to the end lets the
	// reader check its digest.
	var extra json.RawMessage
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err == nil {
			err = errors.New("data after the trailer")
		}
		return nil, fmt.Errorf("after the trailer: %w", err)
	}
	return s, nil
}

// snapshots is the planner's checkpointing: it writes the state into the
// object store and loads the latest snapshot at start. It embeds the
// planner whose state it writes.
type snapshots struct {
	*Planner
	// loaded is the sequence of the snapshot Run started from, 0 after a
	// full replay; set before the projection follows the log.
	loaded uint64
	// seq is the sequence of the newest snapshot this replica wrote,
	// loaded or found stored.
	seq uint64
	// kick asks the snapshot loop for a snapshot.
	kick chan struct{}
	// store is the snapshot object store, opened on first use by the one
	// goroutine that loads or writes snapshots at a time.
	store jetstream.ObjectStore
}

// snapshotStore returns the snapshot object store, opened on first use.
func (sn *snapshots) snapshotStore(ctx context.Context) (jetstream.ObjectStore, error) {
	if sn.store != nil {
		return sn.store, nil
	}
	obs, err := sn.conn.JS.ObjectStore(ctx, bus.ObjectSnapshots)
	if err != nil {
		return nil, fmt.Errorf("object store %s: %w", bus.ObjectSnapshots, err)
	}
	sn.store = obs
	return obs, nil
}

// errNoSnapshot means no snapshot was ever written; last is the stream's
// last sequence.
type errNoSnapshot struct{ last uint64 }

func (e errNoSnapshot) Error() string { return "no snapshot has been written yet" }

// loadSnapshot returns the state of the latest snapshot, checked against
// the event log, or nil (with a warning saying why) when the log must be
// replayed from its start. A missing snapshot is worth a warning only when
// the log is long enough that one should have been written.
func (sn *snapshots) loadSnapshot(ctx context.Context) *state {
	st, err := sn.readSnapshot(ctx)
	if err == nil {
		return st
	}
	if ctx.Err() != nil {
		return nil
	}
	level := slog.LevelWarn
	var none errNoSnapshot
	if errors.As(err, &none) && (sn.cfg.SnapshotEvery < 0 || none.last < uint64(sn.cfg.SnapshotEvery)) {
		level = slog.LevelInfo
	}
	sn.log.Log(ctx, level, "no usable planner snapshot; replaying the whole event log", "reason", err.Error())
	return nil
}

// readSnapshot reads and checks the latest snapshot.
func (sn *snapshots) readSnapshot(ctx context.Context) (*state, error) {
	obs, err := sn.snapshotStore(ctx)
	if err != nil {
		return nil, err
	}
	stream, err := sn.conn.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", bus.EventsStream, err)
	}
	si, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", bus.EventsStream, err)
	}
	info, err := obs.GetInfo(ctx, snapshotObject)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return nil, errNoSnapshot{last: si.State.LastSeq}
	}
	if err != nil {
		return nil, fmt.Errorf("read the snapshot's info: %w", err)
	}
	if v := info.Metadata[metaVersion]; v != strconv.Itoa(snapshotVersion) {
		return nil, fmt.Errorf("%w %q (this planner reads version %d)", errSnapshotVersion, v, snapshotVersion)
	}
	seq, err := strconv.ParseUint(info.Metadata[metaSeq], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("the snapshot's sequence %q is unreadable", info.Metadata[metaSeq])
	}
	if last := si.State.LastSeq; seq > last {
		return nil, fmt.Errorf("the snapshot covers sequence %d but %s ends at %d: it was taken from another stream (recreated?)",
			seq, bus.EventsStream, last)
	}
	res, err := obs.Get(ctx, snapshotObject)
	if err != nil {
		return nil, fmt.Errorf("read the snapshot: %w", err)
	}
	defer res.Close()
	st, err := decodeSnapshot(res, sn.log, sn.cfg.KeepFinished)
	if err != nil {
		return nil, fmt.Errorf("the snapshot is unreadable: %w", err)
	}
	if st.seq != seq {
		return nil, fmt.Errorf("the snapshot's body covers sequence %d, its info says %d", st.seq, seq)
	}
	if err := sn.checkAnchor(ctx, stream, st.anchor); err != nil {
		return nil, err
	}
	return st, nil
}

// checkAnchor verifies that the event the snapshot names is in the stream
// at its sequence.
func (sn *snapshots) checkAnchor(ctx context.Context, stream jetstream.Stream, a anchor) error {
	if a.Seq == 0 {
		return nil
	}
	raw, err := stream.GetMsg(ctx, a.Seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("the event the snapshot names (sequence %d) is not in %s: it was taken from another stream", a.Seq, bus.EventsStream)
	}
	if err != nil {
		return fmt.Errorf("read the event the snapshot names (sequence %d): %w", a.Seq, err)
	}
	env, err := events.DecodeEnvelope(raw.Data)
	if err != nil || env.ID != a.ID {
		return fmt.Errorf("the event at sequence %d is not the one the snapshot names (%s): it was taken from another stream", a.Seq, a.ID)
	}
	return nil
}

// errSnapshotSkipped means no snapshot was written: the stored one is at
// least as new. errSnapshotBusy means another replica is writing one.
var (
	errSnapshotSkipped = errors.New("the stored snapshot is as new")
	errSnapshotBusy    = errors.New("another replica is writing a snapshot")
)

// writeSnapshot checkpoints the state: it copies it under the lock, then
// encodes it straight into the object store. It returns the sequence the
// snapshot covers; [errSnapshotBusy] when another replica holds the write
// claim; the stored snapshot's sequence and [errSnapshotSkipped] when that
// one is at least as new.
func (sn *snapshots) writeSnapshot(ctx context.Context) (uint64, error) {
	obs, err := sn.snapshotStore(ctx)
	if err != nil {
		return 0, err
	}
	if sn.lease.kv != nil {
		rev, err := sn.lease.kv.Create(ctx, snapshotClaimKey, []byte(sn.cfg.ID))
		if errors.Is(err, jetstream.ErrKeyExists) {
			return 0, errSnapshotBusy
		}
		if err != nil {
			return 0, fmt.Errorf("claim the snapshot writer key: %w", err)
		}
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = sn.lease.kv.Delete(dctx, snapshotClaimKey, jetstream.LastRevision(rev))
		}()
	}
	sn.mu.Lock()
	img := sn.st.image()
	sn.mu.Unlock()
	seq := img.header.Seq
	if info, err := obs.GetInfo(ctx, snapshotObject); err == nil && info.Metadata[metaVersion] == strconv.Itoa(snapshotVersion) {
		if have, err := strconv.ParseUint(info.Metadata[metaSeq], 10, 64); err == nil && have >= seq {
			return have, errSnapshotSkipped
		}
	}
	pr, pw := io.Pipe()
	encoded := make(chan error, 1)
	go func() {
		err := img.encode(pw)
		pw.CloseWithError(err)
		encoded <- err
	}()
	meta := jetstream.ObjectMeta{
		Name:        snapshotObject,
		Description: fmt.Sprintf("planner state at %s sequence %d", bus.EventsStream, seq),
		Metadata:    map[string]string{metaVersion: strconv.Itoa(snapshotVersion), metaSeq: strconv.FormatUint(seq, 10)},
	}
	_, err = obs.Put(ctx, meta, pr)
	// Unblock the encoder if the put stopped reading early.
	pr.CloseWithError(errors.New("snapshot put ended"))
	if eerr := <-encoded; err == nil && eerr != nil {
		err = eerr
	}
	if err != nil {
		return 0, fmt.Errorf("write the snapshot at sequence %d: %w", seq, err)
	}
	return seq, nil
}

// snapshotRetry is how long the snapshot loop waits after a failed write,
// snapshotBusyRetry after finding another replica writing one.
const (
	snapshotRetry     = time.Minute
	snapshotBusyRetry = 5 * time.Second
)

// snapshotLoop writes a snapshot once the projection has advanced
// SnapshotEvery sequences past the last one, and at least every
// SnapshotInterval while it advances. It runs once the projection caught
// up; a kick during the replay is served when it starts.
func (sn *snapshots) snapshotLoop(ctx context.Context) {
	var tick <-chan time.Time
	if sn.cfg.SnapshotInterval > 0 {
		t := time.NewTicker(sn.cfg.SnapshotInterval)
		defer t.Stop()
		tick = t.C
	}
	var retryAt time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-sn.kick:
		case <-tick:
		}
		if time.Now().Before(retryAt) {
			continue
		}
		sn.mu.Lock()
		behind := sn.st.seq - sn.seq
		sn.mu.Unlock()
		if behind == 0 {
			continue
		}
		start := time.Now()
		seq, err := sn.writeSnapshot(ctx)
		switch {
		case errors.Is(err, errSnapshotSkipped):
			sn.noteSnapshot(seq)
			sn.log.Debug("snapshot skipped: the stored one is as new", "stored", seq)
		case errors.Is(err, errSnapshotBusy):
			retryAt = time.Now().Add(snapshotBusyRetry)
			sn.log.Debug("snapshot skipped: another replica is writing one")
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			retryAt = time.Now().Add(snapshotRetry)
			sn.log.Warn("writing a planner snapshot failed; start-up replays more of the log until one is written", "err", err, "retryIn", snapshotRetry.String())
		default:
			sn.noteSnapshot(seq)
			sn.log.Info("planner snapshot written", "seq", seq, "took", time.Since(start).Round(time.Millisecond).String())
		}
	}
}

// noteSnapshot records that a snapshot at seq is stored.
func (sn *snapshots) noteSnapshot(seq uint64) {
	sn.mu.Lock()
	defer sn.mu.Unlock()
	if seq > sn.seq {
		sn.seq = seq
	}
}
