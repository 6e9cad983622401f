package events_test

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// TestGatewaySpecValidate: each bad gateway field is named with its value,
// and a valid spec passes with its defaults.
func TestGatewaySpecValidate(t *testing.T) {
	three, eleven := 3, 11
	cases := []struct {
		name string
		gw   events.GatewaySpec
		want []string // the exact validation messages, none when valid
	}{
		{"empty", events.GatewaySpec{}, nil},
		{"full", events.GatewaySpec{Strategy: events.StrategyLeastConnections, SessionTTL: events.Duration(time.Minute), Retries: &three,
			BanRules: []events.BanRule{{Name: "too-many", Status: []int{429, 403}}, {Name: "captcha", Body: "(?i)captcha", Threshold: 2, Window: events.Duration(30 * time.Second)}}}, nil},
		{"strategy", events.GatewaySpec{Strategy: "fastest"}, []string{`gateway.strategy: must be round-robin, least-connections or random (got "fastest")`}},
		{"retries", events.GatewaySpec{Retries: &eleven}, []string{`gateway.retries: must be between 0 and 10 (got "11")`}},
		{"ttl", events.GatewaySpec{SessionTTL: events.Duration(time.Millisecond)}, []string{`gateway.sessionTTL: must be at least 1s (got "1ms")`}},
		{"rule without condition", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x"}}}, []string{`gateway.banRules[0]: must set status, header or body`}},
		{"rule name", events.GatewaySpec{BanRules: []events.BanRule{{Name: "Bad_Name", Status: []int{429}}}},
			[]string{`gateway.banRules[0].name: must be ` + events.IdentifierRule + ` (got "Bad_Name")`}},
		{"duplicate rule", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{429}}, {Name: "x", Status: []int{403}}}},
			[]string{`gateway.banRules[1].name: is used by another rule (got "x")`}},
		{"status", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{42}}}}, []string{`gateway.banRules[0].status[0]: must be an HTTP status (100-599) (got "42")`}},
		{"body regexp", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Body: "("}}},
			[]string{"gateway.banRules[0].body: must be a regular expression: error parsing regexp: missing closing ): `(` (got \"(\")"}},
		{"header without match", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Header: "Server"}}},
			[]string{`gateway.banRules[0].headerMatch: header and headerMatch go together`}},
	}
	for _, c := range cases {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Gateway: &c.gw}
		spec.Normalize()
		err := spec.Validate()
		var got []string
		var ve *events.ValidationError
		if errors.As(err, &ve) {
			for _, f := range ve.Fields {
				got = append(got, f.Error())
			}
		} else if err != nil {
			t.Fatalf("%s: %v is not a ValidationError", c.name, err)
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: got %q, want %q", c.name, got, c.want)
		}
	}
}

// TestGatewaySpecDefaults: an absent spec and absent fields give the
// documented defaults; retries 0 (no failover) is kept.
func TestGatewaySpecDefaults(t *testing.T) {
	var none *events.GatewaySpec
	if none.StrategyOrDefault() != events.StrategyRoundRobin || none.SessionTTLOrDefault() != 10*time.Minute || none.RetriesOrDefault() != 2 {
		t.Errorf("nil spec: %s %s %d", none.StrategyOrDefault(), none.SessionTTLOrDefault(), none.RetriesOrDefault())
	}
	zero := 0
	g := &events.GatewaySpec{Retries: &zero}
	if g.RetriesOrDefault() != 0 {
		t.Errorf("retries 0: got %d", g.RetriesOrDefault())
	}
	r := events.BanRule{Name: "x", Status: []int{429}}
	if r.ThresholdOrDefault() != 5 || r.WindowOrDefault() != time.Minute {
		t.Errorf("rule defaults: %d %s", r.ThresholdOrDefault(), r.WindowOrDefault())
	}
}

// TestGatewaySpecRoundTrip: the gateway spec survives the public copy and
// JSON (it is in the pool.applied event), and the copy shares nothing.
func TestGatewaySpecRoundTrip(t *testing.T) {
	one := 1
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Auth: &events.ProxyAuth{Username: "u", Password: "secret"},
		Gateway: &events.GatewaySpec{Strategy: events.StrategyRandom, Retries: &one, BanRules: []events.BanRule{{Name: "x", Status: []int{429}}}}}
	pub := spec.Public()
	*pub.Gateway.Retries = 5
	pub.Gateway.BanRules[0].Status[0] = 403
	if *spec.Gateway.Retries != 1 || spec.Gateway.BanRules[0].Status[0] != 429 {
		t.Fatalf("Public shares the gateway spec with the original: %+v", spec.Gateway)
	}
	raw, err := json.Marshal(spec.Public())
	if err != nil {
		t.Fatal(err)
	}
	var back events.PoolSpec
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if back.Gateway == nil || back.Gateway.Strategy != events.StrategyRandom || *back.Gateway.Retries != 1 || back.Gateway.BanRules[0].Status[0] != 429 {
		t.Errorf("round trip: %s", raw)
	}
	if raw, _ := json.Marshal(events.PoolSpec{Name: "demo", Provider: "local"}); strings.Contains(string(raw), "gateway") {
		t.Errorf("a spec without gateway writes one: %s", raw)
	}
}

// TestAutoscaleValidate: min at least 1, max at least min and at most
// MaxPoolSize, a target of 1 or more connections per proxy.
func TestAutoscaleValidate(t *testing.T) {
	cases := []struct {
		a    events.Autoscale
		want []string
	}{
		{events.Autoscale{Min: 2, Max: 10, TargetConnections: 4}, nil},
		{events.Autoscale{Min: 0, Max: 10, TargetConnections: 4}, []string{`autoscale.min: must be 1 or more (got "0")`}},
		{events.Autoscale{Min: 3, Max: 2, TargetConnections: 4}, []string{`autoscale.max: must be at least min (got "2")`}},
		{events.Autoscale{Min: 1, Max: 2, TargetConnections: 0, ScaleDownAfter: events.Duration(time.Second)},
			[]string{`autoscale.targetConnections: must be 1 or more (got "0")`, `autoscale.scaleDownAfter: must be at least 10s (got "1s")`}},
	}
	for _, c := range cases {
		var v events.ValidationError
		c.a.Validate(&v, "autoscale")
		var got []string
		for _, f := range v.Fields {
			got = append(got, f.Error())
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%+v: got %q, want %q", c.a, got, c.want)
		}
	}
}
