package decide

import (
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestScale(t *testing.T) {
	auto := events.Autoscale{Min: 2, Max: 10, TargetConnections: 4, ScaleDownAfter: events.Duration(time.Minute)}
	low := func(ago time.Duration, conns int) *LowDemand { return &LowDemand{Since: t0.Add(-ago), MaxConns: conns} }
	cases := []struct {
		name        string
		size, conns int
		low         *LowDemand
		want        Scaling
	}{
		{name: "demand above size: up at once", size: 2, conns: 13,
			want: Scaling{Size: 4, Reason: "autoscale: 13 connections for 4 proxies"}},
		{name: "up no further than max", size: 2, conns: 400,
			want: Scaling{Size: 10, Reason: "autoscale: 400 connections for 10 proxies"}},
		{name: "demand at size: nothing, and a low stretch ends", size: 3, conns: 12, low: low(time.Hour, 1),
			want: Scaling{}},
		{name: "demand below size starts a low stretch", size: 4, conns: 1,
			want: Scaling{Low: &LowDemand{Since: t0, MaxConns: 1}}},
		{name: "a low stretch keeps its peak", size: 4, conns: 1, low: low(30*time.Second, 9),
			want: Scaling{Low: &LowDemand{Since: t0.Add(-30 * time.Second), MaxConns: 9}}},
		{name: "after scaleDownAfter: down to the stretch's peak", size: 6, conns: 1, low: low(time.Minute, 9),
			want: Scaling{Size: 3, Reason: "autoscale: 9 connections for 3 proxies after 1m0s of low demand"}},
		{name: "down no further than min", size: 6, conns: 0, low: low(2*time.Minute, 0),
			want: Scaling{Size: 2, Reason: "autoscale: 0 connections for 2 proxies after 1m0s of low demand"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Scale(auto, tc.size, tc.conns, tc.low, t0)
			if got.Size != tc.want.Size || got.Reason != tc.want.Reason || (got.Low == nil) != (tc.want.Low == nil) ||
				got.Low != nil && *got.Low != *tc.want.Low {
				t.Errorf("got %+v (low %+v), want %+v (low %+v)", got, got.Low, tc.want, tc.want.Low)
			}
		})
	}
}
