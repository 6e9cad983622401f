package reqlog

import (
	"context"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

func TestOffAndBadSample(t *testing.T) {
	conn := bustest.Start(t)
	if l, err := New(conn.NC, Config{Gateway: "gw", Sample: 0}); err != nil || l != nil {
		t.Fatalf("sample 0: %v, %v; want no logger", l, err)
	}
	for _, s := range []float64{-0.1, 1.5} {
		if _, err := New(conn.NC, Config{Gateway: "gw", Sample: s}); err == nil {
			t.Errorf("sample %v accepted", s)
		}
	}
	if _, err := New(conn.NC, Config{Gateway: "log", Sample: 1}); err == nil {
		t.Error("gateway name log accepted: it is the request log's own token")
	}
	var l *Logger // off: every call is a no-op
	if l.Log(&events.GatewayRequest{}) || l.Sample(&events.GatewayRequest{}) {
		t.Error("a nil logger logs")
	}
}

func TestSampleKeepsErrorsBansAndFailovers(t *testing.T) {
	conn := bustest.Start(t)
	l, err := New(conn.NC, Config{Gateway: "gw", Sample: 0.25})
	if err != nil {
		t.Fatal(err)
	}
	draw := 0.5
	l.random = func() float64 { return draw }
	plain := events.GatewayRequest{Outcome: events.RequestOK, Attempts: 1}
	if l.Sample(&plain) {
		t.Error("a plain success drawn 0.5 is sampled at 0.25")
	}
	draw = 0.1
	if !l.Sample(&plain) {
		t.Error("a plain success drawn 0.1 is not sampled at 0.25")
	}
	draw = 0.9
	for _, r := range []events.GatewayRequest{
		{Outcome: events.RequestError, Attempts: 1},
		{Outcome: events.RequestAborted, Attempts: 1},
		{Outcome: events.RequestOK, Attempts: 1, Ban: "captcha"},
		{Outcome: events.RequestOK, Attempts: 2},
	} {
		if !l.Sample(&r) {
			t.Errorf("%+v left out by the sample; errors, bans and failovers are always kept", r)
		}
	}
}

// TestFullQueueDropsAndCounts: without a publisher draining it, the queue
// fills and further records are dropped at once and counted.
func TestFullQueueDropsAndCounts(t *testing.T) {
	conn := bustest.Start(t)
	l, err := New(conn.NC, Config{Gateway: "gw", Sample: 1, Queue: 2})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if ok := l.Log(&events.GatewayRequest{Outcome: events.RequestOK}); ok != (i < 2) {
			t.Fatalf("record %d queued: %v, want %v", i, ok, i < 2)
		}
	}
	if c := l.Counts(); c.Dropped != 3 || c.Sent != 0 {
		t.Fatalf("counts %+v, want 3 dropped and none sent", c)
	}
}

// TestStreamLimitsHoldUnderLoad publishes far more records than a small
// request log stream holds: every record is stored, and the stream keeps
// within its bounds by dropping the oldest.
func TestStreamLimitsHoldUnderLoad(t *testing.T) {
	conn := bustest.Start(t)
	ctx := testwait.Context(t, 30*time.Second)
	limits := bus.RequestLogLimits{MaxAge: time.Hour, MaxBytes: 16 << 10, MaxMsgs: 40}
	if _, err := conn.JS.UpdateStream(ctx, bus.RequestLogConfig(limits, 1)); err != nil { // the topology declared it
		t.Fatal(err)
	}
	l, err := New(conn.NC, Config{Gateway: "gw", Sample: 1, Queue: 1000})
	if err != nil {
		t.Fatal(err)
	}
	lctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- l.Run(lctx) }()
	const n = 600
	for range n {
		rec := &events.GatewayRequest{Gateway: "gw", Pool: "p", Method: "GET", Scheme: "http", Host: "example.com", Path: "/page", Outcome: events.RequestOK, Status: 200, Proxies: []string{"p-a"}, Attempts: 1}
		for !l.Log(rec) { // the test waits for room; a request would not
			time.Sleep(time.Millisecond)
		}
	}
	s, err := conn.JS.Stream(ctx, bus.RequestLogStream)
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "every record stored", func() bool {
		info, err := s.Info(ctx)
		return err == nil && info.State.LastSeq == n
	})
	stop()
	<-done
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs > uint64(limits.MaxMsgs) || info.State.Bytes > uint64(limits.MaxBytes) || info.State.Msgs == 0 {
		t.Fatalf("stream holds %d records, %d bytes; want at most %d and %d", info.State.Msgs, info.State.Bytes, limits.MaxMsgs, limits.MaxBytes)
	}
	if c := l.Counts(); c.Sent != n || c.Failed != 0 || c.Dropped != 0 {
		t.Fatalf("counts %+v, want %d sent", c, n)
	}
}
