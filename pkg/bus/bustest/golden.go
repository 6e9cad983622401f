package bustest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/internal/srcroot"
)

// GoldenMsg is one FLEET_EVENTS message of a golden event log: what a
// release wrote, kept in pkg/events/testdata/golden-<version>/events.json
// (make golden-log, docs/upgrading.md) and replayed by every later version.
type GoldenMsg struct {
	Seq     uint64          `json:"seq"`
	Subject string          `json:"subject"`
	Header  nats.Header     `json:"header,omitempty"`
	Data    json.RawMessage `json:"data"`
}

// Golden is a release's golden event log and the views that release
// projected from it (views.json: bucket → key → value).
type Golden struct {
	Version string
	Msgs    []GoldenMsg
	Views   map[string]map[string]json.RawMessage
}

// GoldenDir is the directory of release version's golden log.
func GoldenDir(version string) string {
	return srcroot.Join("pkg", "events", "testdata", "golden-"+version)
}

// ReadGolden reads release version's golden log.
func ReadGolden(t testing.TB, version string) Golden {
	t.Helper()
	g := Golden{Version: version}
	dir := GoldenDir(version)
	for name, into := range map[string]any{"events.json": &g.Msgs, "views.json": &g.Views} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("golden log %s: %v", version, err)
		}
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("golden log %s: %s: %v", version, name, err)
		}
	}
	if len(g.Msgs) == 0 {
		t.Fatalf("golden log %s holds no event", version)
	}
	return g
}

// Load appends the golden log to c's FLEET_EVENTS, which must be empty,
// each message at the sequence it had (a sequence the release's stream no
// longer held, such as an expired fence, is left a gap) with its subject,
// data and headers. Of the server's headers (Nats-*) only Nats-Msg-Id is
// sent again: the others made the release's writes conditional or atomic
// batches on that stream (Nats-Expected-*, Nats-Batch-*), would let a
// fence expire during the test (Nats-TTL), or were added by the read
// (Nats-Sequence, ...).
func (g Golden) Load(t testing.TB, c *bus.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	next, gaps := uint64(1), 0
	for _, m := range g.Msgs {
		for ; next < m.Seq; next++ {
			// A gap: a filler that expires on its own, as the release's
			// fence messages did (the stream denies deletes).
			gap := &nats.Msg{Subject: "fleet.evt.golden.gap", Data: []byte("{}"), Header: nats.Header{"Nats-TTL": []string{"1s"}}}
			if _, err := c.JS.PublishMsg(ctx, gap); err != nil {
				t.Fatalf("golden log %s: fill gap %d: %v", g.Version, next, err)
			}
			gaps++
		}
		msg := &nats.Msg{Subject: m.Subject, Data: m.Data, Header: nats.Header{}}
		for k, v := range m.Header {
			if !strings.HasPrefix(k, "Nats-") || k == "Nats-Msg-Id" {
				msg.Header[k] = v
			}
		}
		ack, err := c.JS.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatalf("golden log %s: append %d (%s): %v", g.Version, m.Seq, m.Subject, err)
		}
		if ack.Sequence != m.Seq || ack.Duplicate {
			t.Fatalf("golden log %s: %s stored at %d (duplicate %v), want %d", g.Version, m.Subject, ack.Sequence, ack.Duplicate, m.Seq)
		}
		next = m.Seq + 1
	}
	// The fillers expire before anything reads the log.
	for {
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs == uint64(len(g.Msgs)) {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("golden log %s: %d of %d gap fillers still in the stream", g.Version, int(info.State.Msgs)-len(g.Msgs), gaps)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// GoldenVersions lists the releases that have a golden log, or fails t
// when there is none.
func GoldenVersions(t testing.TB) []string {
	t.Helper()
	root := filepath.Dir(GoldenDir("x"))
	dirs, err := filepath.Glob(filepath.Join(root, "golden-*"))
	if err != nil || len(dirs) == 0 {
		t.Fatalf("no golden event log in %s: %v", root, err)
	}
	out := make([]string, 0, len(dirs))
	for _, d := range dirs {
		out = append(out, strings.TrimPrefix(filepath.Base(d), "golden-"))
	}
	return out
}

// Warnings is a slog handler keeping every record at warn or above: a
// replay of a golden log must leave it empty (no event refused or
// skipped).
type Warnings struct {
	mu    sync.Mutex
	lines []string
}

// Enabled reports whether l is warn or above.
func (w *Warnings) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

// Handle keeps r as one line: level, message, attributes.
func (w *Warnings) Handle(_ context.Context, r slog.Record) error {
	line := fmt.Sprintf("%s %s", r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool { line += " " + a.String(); return true })
	w.mu.Lock()
	w.lines = append(w.lines, line)
	w.mu.Unlock()
	return nil
}

// WithAttrs returns w: the lines keep only each record's own attributes.
func (w *Warnings) WithAttrs([]slog.Attr) slog.Handler { return w }

// WithGroup returns w.
func (w *Warnings) WithGroup(string) slog.Handler { return w }

// Lines returns the records kept so far.
func (w *Warnings) Lines() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.lines...)
}
