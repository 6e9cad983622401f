package decide

import (
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestRotationJitterIsDeterministicAndBounded(t *testing.T) {
	const maxAge = 72 * time.Hour
	distinct := map[time.Duration]bool{}
	for range 50 {
		id := events.NewProxyID("demo")
		j := RotationJitter(id, maxAge)
		if again := RotationJitter(id, maxAge); again != j {
			t.Fatalf("jitter of %s: got %s then %s, want the same", id, j, again)
		}
		if j < 0 || j > maxAge/10 {
			t.Errorf("jitter of %s: got %s, want within [0, %s]", id, j, maxAge/10)
		}
		distinct[j] = true
	}
	if len(distinct) < 40 {
		t.Errorf("jitter spread: got %d distinct values of 50, want proxies spread", len(distinct))
	}
	if j := RotationJitter("demo-aaaaaaaaaa", 0); j != 0 {
		t.Errorf("jitter without maxAge: got %s, want 0", j)
	}

	// A proxy is aged exactly past maxAge plus its jitter.
	created := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	x := Proxy{ProxyView: events.ProxyView{ID: "demo-bbbbbbbbbb", CreatedAt: created}}
	edge := created.Add(maxAge + RotationJitter(x.ID, maxAge))
	cases := []struct {
		now  time.Time
		want bool
	}{
		{created.Add(maxAge), false},
		{edge, false},
		{edge.Add(time.Nanosecond), true},
	}
	for _, tc := range cases {
		if got := IsAged(x, maxAge, tc.now); got != tc.want {
			t.Errorf("isAged at created+%s: got %v, want %v", tc.now.Sub(created), got, tc.want)
		}
	}
}
