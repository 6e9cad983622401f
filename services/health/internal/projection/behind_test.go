package projection_test

import (
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestAnswersFromBehindAreAskedAgain: any replica of a view bucket answers
// the projection's direct gets, and a follower answers from what it has
// applied: one back from a partition answers from behind. A projector
// that trusted it would fold an event into an old state, or into no state
// at all, and drop it. Here the first direct gets of a projector taking
// over are answered as such a replica would: "not found" for a key the
// view holds, or the key's entry from before its last write. The
// projector must ask again until an answer proves it was read up to the
// bucket's last sequence, and fold the event into the key's real state.
func TestAnswersFromBehindAreAskedAgain(t *testing.T) {
	e := open(t)
	stored := e.stored
	apply := func(p *projection.Projector, r projection.Raw) {
		t.Helper()
		if err := p.ApplyBatch(e.ctx, []projection.Raw{r}); err != nil {
			t.Fatal(err)
		}
	}
	// oldEntry is what a direct get of key answers now, kept to be
	// answered again later as a replica from behind would.
	oldEntry := func(key string) []*nats.Msg {
		t.Helper()
		inbox := nats.NewInbox()
		sub, err := e.conn.NC.SubscribeSync(inbox)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
		if err := e.conn.NC.PublishRequest(projection.DirectGetProxies, inbox,
			[]byte(`{"multi_last":["$KV.`+bus.BucketProxies+`.`+key+`"]}`)); err != nil {
			t.Fatal(err)
		}
		var out []*nats.Msg
		for {
			m, err := sub.NextMsgWithContext(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, m)
			if m.Header.Get("Status") != "" {
				return out
			}
		}
	}

	cases := []struct {
		name string
		// setup brings proxy id into the state the event is folded into,
		// and returns what the replica from behind answers.
		setup func(p *projection.Projector, id string) []*nats.Msg
		event func(id string) projection.Raw
		want  string // the proxy's state after the event, "" for no key
	}{{
		name: "not found: the replica has not seen the key",
		setup: func(p *projection.Projector, id string) []*nats.Msg {
			apply(p, stored(id, events.ProxyRequested, requested("demo")))
			apply(p, stored(id, events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 1}))
			apply(p, stored(id, events.ProxyRetiring, events.ProxyRetiringData{Reason: "scaled down"}))
			nf := nats.NewMsg("")
			nf.Header.Set("Status", "404")
			nf.Header.Set("Description", "No Results")
			return []*nats.Msg{nf}
		},
		event: func(id string) projection.Raw {
			return stored(id, events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1})
		},
		want: "", // a deleted proxy's key is deleted
	}, {
		name: "the key's entry before its last write",
		setup: func(p *projection.Projector, id string) []*nats.Msg {
			apply(p, stored(id, events.ProxyRequested, requested("demo")))
			old := oldEntry(id)
			apply(p, stored(id, events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 1}))
			return old
		},
		event: func(id string) projection.Raw {
			return stored(id, events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:9"})
		},
		want: events.ProxyReady,
	}}
	for i, tc := range cases {
		func() {
			id := []string{"a", "b"}[i]
			stale := tc.setup(projection.New(e.conn, nil, nil), id)

			// A projector taking over: its cache is empty, and its first
			// direct gets reach the replica from behind.
			p := projection.New(e.conn, nil, nil)
			subject := nats.NewInbox()
			p.SetDirectGet(subject)
			var fromBehind atomic.Int32
			fromBehind.Store(3)
			sub, err := e.conn.NC.Subscribe(subject, func(m *nats.Msg) {
				if fromBehind.Add(-1) < 0 {
					// A replica that is current: the server's.
					_ = e.conn.NC.PublishRequest(projection.DirectGetProxies, m.Reply, m.Data)
					return
				}
				for _, a := range stale {
					r := nats.NewMsg(m.Reply)
					r.Header, r.Data = a.Header, a.Data
					_ = e.conn.NC.PublishMsg(r)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = sub.Unsubscribe() }()

			ev := tc.event(id)
			apply(p, ev)
			if n := fromBehind.Load(); n > 0 {
				t.Fatalf("%s: the projector asked %d times, not past the %d answers from behind", tc.name, 3-n, 3)
			}
			got, ok := e.proxy(id)
			switch {
			case tc.want == "" && ok:
				t.Errorf("%s: %s after its last event at %d: %s at %d, want its key deleted", tc.name, id, ev.Seq, got.State, got.Seq)
			case tc.want != "" && (got.State != tc.want || got.Seq != ev.Seq):
				t.Errorf("%s: %s after its last event at %d: %s at %d, want %s at %d", tc.name, id, ev.Seq, got.State, got.Seq, tc.want, ev.Seq)
			}
		}()
	}
}
