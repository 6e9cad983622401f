package bus_test

import (
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
)

// TestRequestLogLimits: the topology declares the request log with its
// default bounds; bootstrap's limits replace them, a limit not given keeps
// the stream's, and a service ensuring the topology at start keeps them.
func TestRequestLogLimits(t *testing.T) {
	c := bustest.Start(t)
	ctx := testwait.Context(t, 20*time.Second)
	limits := func() (time.Duration, int64) {
		t.Helper()
		s, err := c.JS.Stream(ctx, bus.RequestLogStream)
		if err != nil {
			t.Fatal(err)
		}
		cfg := s.CachedInfo().Config
		if len(cfg.Subjects) != 1 || cfg.Subjects[0] != "fleet.gateway.log.*" {
			t.Fatalf("request log subjects %v", cfg.Subjects)
		}
		return cfg.MaxAge, cfg.MaxBytes
	}
	if age, size := limits(); age != bus.DefaultRequestLogMaxAge || size != bus.DefaultRequestLogMaxBytes {
		t.Fatalf("default bounds %s, %d", age, size)
	}
	if err := bus.SetRequestLogLimits(ctx, c, bus.RequestLogLimits{MaxAge: 72 * time.Hour, MaxBytes: 8 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := bus.SetRequestLogLimits(ctx, c, bus.RequestLogLimits{MaxAge: 48 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatal(err)
	}
	if age, size := limits(); age != 48*time.Hour || size != 8<<20 {
		t.Fatalf("bounds after bootstrap and a service's start: %s, %d; want 48h and 8 MiB", age, size)
	}
	for _, bad := range []bus.RequestLogLimits{{MaxAge: -time.Hour}, {MaxAge: time.Second}, {MaxBytes: 1000}, {MaxMsgs: -1}} {
		if err := bus.SetRequestLogLimits(ctx, c, bad); err == nil || !strings.Contains(err.Error(), "request log") {
			t.Errorf("limits %+v: %v, want a refusal", bad, err)
		}
	}
	if age, size := limits(); age != 48*time.Hour || size != 8<<20 {
		t.Fatalf("refused limits changed the stream: %s, %d", age, size)
	}
}
