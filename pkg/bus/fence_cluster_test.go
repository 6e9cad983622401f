package bus_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
)

// startCluster runs three JetStream servers routed into one cluster, as an
// operator's deployment is, and returns a connection using three replicas.
//
// Every cluster port comes from the kernel: each server listens on a
// random one and the later servers route to the earlier ones' addresses.
// A clustered JetStream server must start with its full route list (its
// count sets the meta group's expected size), so each server lists three
// routes, and the ones not known yet are reserved addresses that refuse:
// the servers keep retrying those while gossip joins the real three.
func startCluster(t testing.TB) *bus.Conn {
	t.Helper()
	routes := make([]*url.URL, 3)
	for i := range routes {
		routes[i] = &url.URL{Scheme: "nats", Host: testnet.Refusing(t).String()}
	}
	var urls string
	for i := range routes {
		opts := &server.Options{
			ServerName: fmt.Sprintf("n%d", i+1),
			Host:       "127.0.0.1",
			Port:       server.RANDOM_PORT,
			JetStream:  true,
			StoreDir:   t.TempDir(),
			Cluster:    server.ClusterOpts{Name: "fence", Host: "127.0.0.1", Port: server.RANDOM_PORT},
			Routes:     slices.Clone(routes),
		}
		srv := bustest.Server(t, opts)
		routes[i] = &url.URL{Scheme: "nats", Host: srv.ClusterAddr().String()}
		if urls != "" {
			urls += ","
		}
		urls += srv.ClientURL()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var c *bus.Conn
	var err error
	// JetStream answers once the cluster has elected its meta leader;
	// until then each attempt gets a short deadline of its own.
	for {
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		c, err = bus.Connect(actx, bus.Config{URL: urls, Name: t.Name(), Replicas: 3}, nil)
		acancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("cluster: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Cleanup(c.Close)
	for {
		err = bus.EnsureTopology(ctx, c)
		if err == nil {
			return c
		}
		if ctx.Err() != nil {
			t.Fatalf("topology on the cluster: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestFencedAppendOnReplicatedStream: the fence holds on an R3 stream too,
// where an atomic batch is checked and proposed through the stream's Raft
// group instead of committed by one server.
func TestFencedAppendOnReplicatedStream(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-server cluster")
	}
	ctx := context.Background()
	c := startCluster(t)
	s := bus.NewEventStore(c, "planner", nil)
	ta, err := s.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatal(err)
	}
	seq, err := s.AppendFenced(ctx, ta, events.AggregateProxy, "p1", events.ProxyRequested, "p1.requested.1", map[string]string{}, &bus.Expect{Seq: 0})
	if err != nil {
		t.Fatalf("fenced append in the current term: %v", err)
	}
	if _, err := s.ClaimTerm(ctx, "b", 2); err != nil {
		t.Fatal(err)
	}
	before := eventCount(t, c)
	for _, tc := range []struct {
		id, typ string
		expect  *bus.Expect
	}{
		{"p2", events.ProxyRequested, &bus.Expect{Seq: 0}},
		{"p1", events.ProxyRetiring, &bus.Expect{Seq: seq}},
	} {
		if _, err := s.AppendFenced(ctx, ta, events.AggregateProxy, tc.id, tc.typ, tc.id+"."+tc.typ+".stale", map[string]string{}, tc.expect); !errors.Is(err, bus.ErrFenced) {
			t.Errorf("%s %s by the deposed leader: got %v, want ErrFenced", tc.typ, tc.id, err)
		}
	}
	if after := eventCount(t, c); after != before {
		t.Fatalf("stream holds %d messages besides fences after the refused appends, had %d", after, before)
	}
}

// BenchmarkAppendReplicated measures appends to an R3 stream of a
// three-server cluster, where a staged atomic batch is held in memory (an
// R1 file stream stages it in a file store of its own, synced to disk):
// the baseline is an observation (EventStore.Append), "decision" adds the
// aggregate expectation, "fenced" is EventStore.AppendFenced.
func BenchmarkAppendReplicated(b *testing.B) {
	ctx := context.Background()
	c := startCluster(b)
	s := bus.NewEventStore(c, "bench", nil)
	data := events.ProxyRunningData{Address: "127.0.0.1:20000", Attempt: 1, ProviderID: "px-aaaaaaaaaaaaaaaa"}
	b.Run("baseline", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			id := fmt.Sprintf("base-%d", i)
			if _, err := s.Append(ctx, events.AggregateProxy, id, events.ProxyRunning, id+".running.1", data, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	benchDecisions(ctx, b, s, data)
}

// TestFencedBatchesOnReplicatedStream: on a replicated stream, fenced
// batches sent one after the other (each verdict read before the next
// batch leaves, as the planner sends them) are stored whole, and one
// failed expectation refuses its whole batch.
func TestFencedBatchesOnReplicatedStream(t *testing.T) {
	ctx := context.Background()
	c := startCluster(t)
	s := bus.NewEventStore(c, "planner", nil)
	term, err := s.ClaimTerm(ctx, "a", 1)
	if err != nil {
		t.Fatal(err)
	}
	for b := range 4 {
		var ds []bus.Decision
		for i := range 100 {
			id := fmt.Sprintf("r%d-%d", b, i)
			expect := uint64(0)
			if b == 2 && i == 50 {
				expect = 7
			}
			ds = append(ds, bus.Decision{Aggregate: events.AggregateProxy, ID: id, Type: events.ProxyRequested, MsgID: id + ".requested.1",
				Data: map[string]string{"id": id}, Expect: &bus.Expect{Seq: expect}})
		}
		before := eventCount(t, c)
		seq, err := s.StartFenced(ctx, term, ds...).Wait(ctx)
		if b == 2 {
			if !errors.Is(err, bus.ErrConflict) {
				t.Fatalf("batch 2: got %d, %v; want ErrConflict", seq, err)
			}
			if after := eventCount(t, c); after != before {
				t.Fatalf("the refused batch left the stream at %d messages besides fences, from %d", after, before)
			}
			continue
		}
		if err != nil {
			t.Fatalf("batch %d: %v", b, err)
		}
		for i := range 100 {
			id := fmt.Sprintf("r%d-%d", b, i)
			if last := waitLast(ctx, t, s, id); last.Seq != seq-uint64(99-i) {
				t.Fatalf("%s stored at %d; want %d", id, last.Seq, seq-uint64(99-i))
			}
		}
	}
}

// waitLast returns the last event of proxy id once a direct get finds it:
// any replica of an R3 stream answers one, and a follower may not have
// applied an acknowledged batch yet.
func waitLast(ctx context.Context, t *testing.T, s *bus.EventStore, id string) *bus.Event {
	t.Helper()
	var last *bus.Event
	testwait.Until(t, 30*time.Second, id+" stored", func() bool {
		var err error
		if last, err = s.Last(ctx, events.AggregateProxy, id); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		return last != nil
	})
	return last
}
