package events_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// maxEvent is the most an event may take: NATS's default max payload
// (1 MiB), less room for the headers a fenced append adds.
const maxEvent = 1<<20 - 8<<10

// TestLargestSpecFitsInAnEvent: every field of a pool spec has a limit, so
// the largest spec Validate accepts still fits in its pool.applied event.
// Each string is at its limit and made of '<', which JSON writes in six
// bytes ("\u003c"), each list is at its limit.
func TestLargestSpecFitsInAnEvent(t *testing.T) {
	id := func(i int) string { return fmt.Sprintf("%s%08d", strings.Repeat("t", 55), i) } // 63 characters
	worst := func(n int) string { return strings.Repeat("<", n) }
	spec := events.PoolSpec{
		Name: id(0), Provider: id(1), Size: events.MaxPoolSize, Image: id(2), Profile: id(3), Port: 65535,
		Auth:           &events.ProxyAuth{Username: worst(events.MaxUsernameBytes), Password: "p"},
		MaxAge:         events.Duration(time.Hour),
		UnhealthyAfter: events.Duration(time.Minute),
		Egress:         &events.Egress{},
		Gateway:        &events.GatewaySpec{Strategy: events.StrategyLeastConnections, SessionTTL: events.Duration(time.Hour)},
		Autoscale:      &events.Autoscale{Min: 1, Max: events.MaxPoolSize, TargetConnections: 1 << 30},
	}
	for i := range events.MaxTargets {
		spec.Targets = append(spec.Targets, id(i))
	}
	for i := range events.MaxEgressAllows {
		spec.Egress.AllowCIDRs = append(spec.Egress.AllowCIDRs, fmt.Sprintf("ffff:ffff:ffff:ffff:ffff:ffff:ffff:%04x/128", i))
		spec.Egress.AllowPorts = append(spec.Egress.AllowPorts, 60000+i)
	}
	for i := range events.MaxBanRules {
		r := events.BanRule{Name: id(i), Header: strings.Repeat("X", events.MaxHeaderName),
			HeaderMatch: worst(events.MaxBanPattern), Body: worst(events.MaxBanPattern), Threshold: 1 << 30, Window: events.Duration(time.Hour)}
		for s := range events.MaxBanStatuses {
			r.Status = append(r.Status, 500+s)
		}
		spec.Gateway.BanRules = append(spec.Gateway.BanRules, r)
	}
	if err := spec.Validate(); err != nil {
		t.Fatalf("the largest spec is refused: %v", err)
	}
	data := events.PoolAppliedData{Spec: spec.Public(), Revision: 1 << 30, SecretsDigest: strings.Repeat("f", 64)}
	env, err := events.NewEnvelope(strings.Repeat("m", 200), events.SourcePlanner, events.EnvelopeType(events.AggregatePool, events.PoolApplied), spec.Name, time.Now(), data)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > maxEvent {
		t.Errorf("the largest accepted spec's event takes %d bytes, over %d", len(b), maxEvent)
	}
	t.Logf("the largest accepted spec's event: %d bytes", len(b))

	// One more of anything is refused.
	for name, grow := range map[string]func(s *events.PoolSpec){
		"targets":           func(s *events.PoolSpec) { s.Targets = append(s.Targets, "one-more") },
		"auth.username":     func(s *events.PoolSpec) { s.Auth.Username += "u" },
		"userData":          func(s *events.PoolSpec) { s.UserData = worst(events.MaxUserDataBytes + 1) },
		"egress.allowCIDRs": func(s *events.PoolSpec) { s.Egress.AllowCIDRs = append(s.Egress.AllowCIDRs, "10.0.0.0/8") },
		"gateway.banRules": func(s *events.PoolSpec) {
			s.Gateway.BanRules = append(s.Gateway.BanRules, events.BanRule{Name: "more", Status: []int{403}})
		},
		"gateway.banRules[0].status":      func(s *events.PoolSpec) { s.Gateway.BanRules[0].Status = append(s.Gateway.BanRules[0].Status, 403) },
		"gateway.banRules[0].header":      func(s *events.PoolSpec) { s.Gateway.BanRules[0].Header += "X" },
		"gateway.banRules[0].headerMatch": func(s *events.PoolSpec) { s.Gateway.BanRules[0].HeaderMatch += "<" },
		"gateway.banRules[0].body":        func(s *events.PoolSpec) { s.Gateway.BanRules[0].Body += "<" },
	} {
		t.Run(name, func(t *testing.T) {
			s := spec
			s.Targets = append([]string(nil), spec.Targets...)
			a := *spec.Auth
			s.Auth = &a
			s.Egress = spec.Egress.Clone()
			s.Gateway = spec.Gateway.Clone()
			grow(&s)
			err := s.Validate()
			if err == nil || !strings.Contains(err.Error(), name+": ") {
				t.Errorf("one more: got %v, want a refusal naming %s", err, name)
			}
		})
	}
}
