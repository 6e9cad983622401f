package bustest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
)

// ceilingInFlight is how many publishes [Ceiling] keeps unacknowledged.
const ceilingInFlight = 2048

// Ceiling is the baseline the converge benchmarks divide by: the time
// JetStream's file store on c takes to store n messages of about a proxy
// event's size (300 bytes), each with a Msg-Id of its own (round keeps
// the ids of one benchmark round apart from another's, inside the
// duplicate window), published asynchronously with ceilingInFlight in
// flight. It creates the stream CEILING on "ceiling.>" the first time.
func Ceiling(tb testing.TB, c *bus.Conn, round, n int) time.Duration {
	tb.Helper()
	if _, err := c.JS.CreateOrUpdateStream(context.Background(), jetstream.StreamConfig{Name: "CEILING", Subjects: []string{"ceiling.>"},
		Storage: jetstream.FileStorage, Duplicates: bus.DuplicateWindow}); err != nil {
		tb.Fatal(err)
	}
	body := make([]byte, 300)
	start := time.Now()
	pending := make([]jetstream.PubAckFuture, 0, ceilingInFlight)
	for i := range n {
		msg := nats.NewMsg(fmt.Sprintf("ceiling.%d", i))
		msg.Data = body
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("m%d.%d", round, i))
		f, err := c.JS.PublishMsgAsync(msg)
		if err != nil {
			tb.Fatal(err)
		}
		pending = append(pending, f)
		if len(pending) == ceilingInFlight {
			WaitAcks(tb, pending)
			pending = pending[:0]
		}
	}
	WaitAcks(tb, pending)
	return time.Since(start)
}

// WaitAcks fails tb unless every publish of fs is acknowledged, each
// within 30 s.
func WaitAcks(tb testing.TB, fs []jetstream.PubAckFuture) {
	tb.Helper()
	for _, f := range fs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			tb.Fatal(err)
		case <-time.After(30 * time.Second):
			tb.Fatal("no acknowledgement in 30s")
		}
	}
}
