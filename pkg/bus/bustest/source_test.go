package bustest_test

import (
	"testing"

	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// Every event a harness appends with Source passes the readers' check.
func TestSourcePassesCheckEvent(t *testing.T) {
	tests := []struct {
		aggregate, typ, want string
	}{
		{events.AggregateProxy, events.ProxyRequested, events.SourcePlanner},
		{events.AggregateProxy, events.ProxyProvisioning, "proxyfleet/agent/local/t1"},
		{events.AggregateProxy, events.ProxyRunning, "proxyfleet/agent/local/t1"},
		{events.AggregateProxy, events.ProxyReady, events.SourceHealth},
		{events.AggregateProxy, events.ProxyUnhealthy, events.SourceHealth},
		{events.AggregateProxy, events.ProxyFailed, events.SourcePlanner},
		{events.AggregateProxy, events.ProxyRetiring, events.SourcePlanner},
		{events.AggregateProxy, events.ProxyDeleted, "proxyfleet/agent/local/t1"},
		{events.AggregateProxy, events.ProxyAbandoned, events.SourcePlanner},
		{events.AggregatePool, events.PoolApplied, events.SourcePlanner},
		{events.AggregatePool, events.PoolDeleted, events.SourcePlanner},
		{events.AggregatePool, "conditions", events.SourcePlanner},
	}
	for _, tt := range tests {
		got := bustest.Source(tt.aggregate, tt.typ)
		if got != tt.want {
			t.Errorf("Source(%q, %q) = %q; want %q", tt.aggregate, tt.typ, got, tt.want)
		}
		by, _ := events.ParseAgentSource(got)
		if fe := events.CheckEvent(tt.aggregate, "demo-a", tt.typ, got, by); fe != nil {
			t.Errorf("CheckEvent(%q, %q) with source %q: %v; want nil", tt.aggregate, tt.typ, got, fe)
		}
	}
}
