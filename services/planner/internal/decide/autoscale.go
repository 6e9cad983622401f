package decide

import (
	"fmt"
	"time"

	"proxyfleet/pkg/events"
)

// LowDemand is an autoscaled pool's current stretch of demand below its
// size: since when, and the most connections reported during it.
type LowDemand struct {
	Since    time.Time
	MaxConns int
}

// Scaling is what [Scale] decided for one autoscaled pool.
type Scaling struct {
	// Size is the pool's new size; 0 when it stays as it is.
	Size   int
	Reason string
	// Low is the stretch of low demand still under way, nil when none.
	Low *LowDemand
}

// Scale sizes an autoscaled pool of size proxies by the conns client
// connections its gateways report, at now on the clock low demand is
// measured with: up at once to what the demand calls for; down only once
// demand stayed lower for the whole scaleDownAfter, and then to the most
// that stretch called for. low is the stretch under way, if any.
func Scale(auto events.Autoscale, size, conns int, low *LowDemand, now time.Time) Scaling {
	want := auto.Want(conns)
	switch {
	case want > size:
		return Scaling{Size: want, Reason: fmt.Sprintf("autoscale: %d connections for %d proxies", conns, want)}
	case want == size:
		return Scaling{}
	}
	l := LowDemand{Since: now}
	if low != nil {
		l = *low
	}
	l.MaxConns = max(l.MaxConns, conns)
	after := auto.ScaleDownAfterOrDefault()
	if now.Sub(l.Since) < after {
		return Scaling{Low: &l}
	}
	if peak := auto.Want(l.MaxConns); peak < size {
		return Scaling{Size: peak, Reason: fmt.Sprintf("autoscale: %d connections for %d proxies after %s of low demand", l.MaxConns, peak, after)}
	}
	return Scaling{}
}
