package projection_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/services/health/internal/projection"
)

// TestGoldenLogsReplay: every release's golden event log
// (pkg/events/testdata/golden-<version>, written by that release's
// binaries: make golden-log) loaded into a fresh stream is projected by
// today's health without a warning (no event refused or skipped), into
// views with the release's keys whose every field both versions have is
// equal to the release's.
func TestGoldenLogsReplay(t *testing.T) {
	for _, version := range bustest.GoldenVersions(t) {
		t.Run(version, func(t *testing.T) {
			e := open(t)
			g := bustest.ReadGolden(t, version)
			g.Load(t, e.conn)
			rec := &bustest.Warnings{}
			ctx, cancel := context.WithCancel(e.ctx)
			done := make(chan error, 1)
			go func() { done <- projection.New(e.conn, slog.New(rec), nil).Run(ctx) }()
			e.stop = func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("projector: %v", err)
				}
				e.stop = func() {}
			}
			e.caughtUp()
			e.stop()
			if w := rec.Lines(); len(w) > 0 {
				t.Errorf("the projection of %s's log warned %d times (an event refused or skipped):\n%s", version, len(w), strings.Join(w, "\n"))
			}
			for bucket, want := range g.Views {
				got := e.bucket(bucket)
				compareViews(t, version, bucket, got, want)
			}
			if !t.Failed() {
				t.Logf("%s: %d events replayed; %d proxies and %d pools equal the release's views", version, len(g.Msgs),
					len(g.Views[bus.BucketProxies]), len(g.Views[bus.BucketPools]))
			}
		})
	}
}

// compareViews requires got to hold exactly want's keys and, in each
// value, every field present in both to be equal; a value must share its
// identifying fields with the release's so that the comparison is not
// empty.
func compareViews(t *testing.T, version, bucket string, got, want map[string]json.RawMessage) {
	t.Helper()
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		g, ok := got[k]
		if !ok {
			t.Errorf("%s: %s/%s is missing after the replay", version, bucket, k)
			continue
		}
		var gv, wv map[string]any
		if err := json.Unmarshal(g, &gv); err != nil {
			t.Fatalf("%s/%s: %v", bucket, k, err)
		}
		if err := json.Unmarshal(want[k], &wv); err != nil {
			t.Fatalf("golden %s/%s: %v", bucket, k, err)
		}
		shared := 0
		for f, w := range wv {
			if gf, ok := gv[f]; ok {
				shared++
				if !reflect.DeepEqual(gf, w) {
					t.Errorf("%s: %s/%s field %s = %v after the replay, the release had %v", version, bucket, k, f, gf, w)
				}
			}
		}
		if shared < 3 {
			t.Errorf("%s: %s/%s shares %d fields with the release's value: %s vs %s", version, bucket, k, shared, g, want[k])
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: %s/%s after the replay, which the release's views do not have: %s", version, bucket, k, got[k])
		}
	}
}

// bucket reads every key of a view.
func (e *env) bucket(name string) map[string]json.RawMessage {
	e.t.Helper()
	kv, err := e.conn.JS.KeyValue(e.ctx, name)
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]json.RawMessage{}
	keys, err := kv.Keys(e.ctx)
	if errors.Is(err, jetstream.ErrNoKeysFound) {
		return out
	}
	if err != nil {
		e.t.Fatal(err)
	}
	for _, k := range keys {
		entry, err := kv.Get(e.ctx, k)
		if err != nil {
			e.t.Fatalf("%s/%s: %v", name, k, err)
		}
		out[k] = entry.Value()
	}
	return out
}
