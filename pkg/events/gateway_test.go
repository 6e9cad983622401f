package events_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// TestGatewaySpecValidate: each bad gateway field is named with its value,
// and a valid spec passes with its defaults.
func TestGatewaySpecValidate(t *testing.T) {
	three, eleven, zero, minus := 3, 11, 0, -1
	cases := []struct {
		name string
		gw   events.GatewaySpec
		want []string // the exact validation messages, none when valid
	}{
		{"empty", events.GatewaySpec{}, nil},
		{"intercept", events.GatewaySpec{Intercept: true}, nil},
		{"full", events.GatewaySpec{Strategy: events.StrategyLeastConnections, SessionTTL: events.Duration(time.Minute), Retries: &three, Intercept: true,
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
		{"actions", events.GatewaySpec{RetireAfterSites: &zero, RetireAfterSitesWindow: events.Duration(24 * time.Hour), BanRules: []events.BanRule{
			{Name: "a", Status: []int{403}, Action: events.BanActionRetire, Threshold: 3},
			{Name: "b", Status: []int{429}, Action: events.BanActionCooldown, Cooldown: events.Duration(2 * time.Hour), Threshold: 2, Window: events.Duration(time.Minute)},
			{Name: "c", Status: []int{503}, Action: events.BanActionRetry}}}, nil},
		{"unknown action", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{429}, Action: "block"}}},
			[]string{`gateway.banRules[0].action: must be retire, cooldown or retry (got "block")`}},
		{"cooldown on a retire rule", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{429}, Cooldown: events.Duration(time.Minute)}}},
			[]string{`gateway.banRules[0].cooldown: only a rule with action "cooldown" sets it (got "1m0s")`}},
		{"cooldown on a retry rule", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{429}, Action: events.BanActionRetry, Cooldown: events.Duration(time.Minute)}}},
			[]string{`gateway.banRules[0].cooldown: only a rule with action "cooldown" sets it (got "1m0s")`}},
		{"threshold on a retry rule", events.GatewaySpec{BanRules: []events.BanRule{{Name: "x", Status: []int{429}, Action: events.BanActionRetry, Threshold: 2}}},
			[]string{`gateway.banRules[0].action: a retry rule gives no verdict: leave threshold and window out, or use retire or cooldown (got "retry")`}},
		{"cooldown bounds", events.GatewaySpec{BanRules: []events.BanRule{
			{Name: "x", Status: []int{429}, Action: events.BanActionCooldown, Cooldown: events.Duration(time.Millisecond)},
			{Name: "y", Status: []int{429}, Action: events.BanActionCooldown, Cooldown: events.Duration(25 * time.Hour)},
			{Name: "z", Status: []int{429}, Action: events.BanActionCooldown, Cooldown: events.Duration(-time.Second)}}},
			[]string{`gateway.banRules[0].cooldown: must be between 1s and 24h0m0s (got "1ms")`, `gateway.banRules[1].cooldown: must be between 1s and 24h0m0s (got "25h0m0s")`,
				`gateway.banRules[2].cooldown: must be between 1s and 24h0m0s (got "-1s")`}},
		{"retire after sites", events.GatewaySpec{RetireAfterSites: &minus, RetireAfterSitesWindow: events.Duration(time.Second)},
			[]string{`gateway.retireAfterSites: must be between 0 (never) and 1000 (got "-1")`, `gateway.retireAfterSitesWindow: must be between 1m0s and 24h0m0s (got "1s")`}},
		{"politeness", events.GatewaySpec{PerSite: &events.PerSite{Concurrency: 2, Rate: 0.5, QueueTimeout: events.Duration(10 * time.Second)}}, nil},
		{"politeness without limits", events.GatewaySpec{PerSite: &events.PerSite{}}, []string{`gateway.perSite: must set concurrency or rate (or be left out)`}},
		{"politeness out of bounds", events.GatewaySpec{PerSite: &events.PerSite{Concurrency: -1, Rate: 0.001, QueueTimeout: events.Duration(2 * time.Minute)}}, []string{
			`gateway.perSite.concurrency: must be between 1 and 10000 requests at once (0 or absent: unlimited) (got "-1")`,
			`gateway.perSite.rate: must be between 0.01 and 10000 requests per second (0 or absent: unlimited) (got "0.001")`,
			`gateway.perSite.queueTimeout: must be between 0 (the default, 5s) and 1m0s (got "2m0s")`,
		}},
		{"politeness rate too high", events.GatewaySpec{PerSite: &events.PerSite{Rate: 20000, QueueTimeout: events.Duration(-time.Second)}}, []string{
			`gateway.perSite.rate: must be between 0.01 and 10000 requests per second (0 or absent: unlimited) (got "20000")`,
			`gateway.perSite.queueTimeout: must be between 0 (the default, 5s) and 1m0s (got "-1s")`,
		}},
		{"rotation", events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: 10, MaxAge: events.Duration(time.Minute)}}, nil},
		{"fallback", events.GatewaySpec{Fallback: []string{"cheap", "premium"}, TierMemory: events.Duration(time.Hour)}, nil},
		{"fallback names", events.GatewaySpec{Fallback: []string{"demo", "Bad.Pool", "cheap", "cheap"}}, []string{
			`gateway.fallback[0]: names this pool itself; name other pools to fall back to (got "demo")`,
			`gateway.fallback[1]: must be ` + events.IdentifierRule + ` (got "Bad.Pool")`,
			`gateway.fallback[3]: is named twice (got "cheap")`,
		}},
		{"fallback too long", events.GatewaySpec{Fallback: []string{"a", "b", "c", "d", "e"}}, []string{`gateway.fallback: may name at most 4 pools (got "5")`}},
		{"tier memory bounds", events.GatewaySpec{TierMemory: events.Duration(time.Millisecond)}, []string{`gateway.tierMemory: must be between 1s and 24h0m0s (got "1ms")`}},
		{"tier memory too long", events.GatewaySpec{TierMemory: events.Duration(25 * time.Hour)}, []string{`gateway.tierMemory: must be between 1s and 24h0m0s (got "25h0m0s")`}},
		{"tier memory negative", events.GatewaySpec{TierMemory: events.Duration(-time.Second)}, []string{`gateway.tierMemory: must be between 1s and 24h0m0s (got "-1s")`}},
		{"rotation without limits", events.GatewaySpec{Session: &events.SessionRotation{}}, []string{`gateway.session: must set maxRequests or maxAge (or be left out)`}},
		{"rotation out of bounds", events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: -2, MaxAge: events.Duration(time.Millisecond)}}, []string{
			`gateway.session.maxRequests: must be between 1 and 1000000 (0 or absent: no limit) (got "-2")`,
			`gateway.session.maxAge: must be at least 1s (got "1ms")`,
		}},
	}
	for _, c := range cases {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Gateway: &c.gw}
		spec.Normalize()
		if got := fieldMessages(t, c.name, spec.Validate()); !slices.Equal(got, c.want) {
			t.Errorf("%s: got %q, want %q", c.name, got, c.want)
		}
	}
}

// fieldMessages is the message of each field of err, a
// [events.ValidationError] (none when err is nil); the test of name fails
// at once on any other error.
func fieldMessages(t *testing.T, name string, err error) []string {
	t.Helper()
	var ve *events.ValidationError
	if err != nil && !errors.As(err, &ve) {
		t.Fatalf("%s: %v is not a ValidationError", name, err)
	}
	var got []string
	if ve != nil {
		for _, f := range ve.Fields {
			got = append(got, f.Error())
		}
	}
	return got
}

// jsonRoundTrip encodes spec and decodes it again.
func jsonRoundTrip(t *testing.T, spec events.PoolSpec) (raw []byte, back events.PoolSpec) {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	return raw, back
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
	var noSite *events.PerSite
	if noSite.QueueTimeoutOrDefault() != 5*time.Second || (&events.PerSite{QueueTimeout: events.Duration(time.Second)}).QueueTimeoutOrDefault() != time.Second {
		t.Errorf("queue timeout defaults: %s", noSite.QueueTimeoutOrDefault())
	}
	for rate, want := range map[float64]int{0.5: 1, 1: 1, 4: 1, 4.5: 2, 10: 3, 100: 25} {
		if got := (&events.PerSite{Rate: rate}).Burst(); got != want {
			t.Errorf("burst at rate %g: %d, want %d", rate, got, want)
		}
	}
}

// TestGatewaySpecRoundTrip: the gateway spec survives the public copy and
// JSON (it is in the pool.applied event), and the copy shares nothing.
func TestGatewaySpecRoundTrip(t *testing.T) {
	one := 1
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Auth: &events.ProxyAuth{Username: "u", Password: "secret"},
		Gateway: &events.GatewaySpec{Strategy: events.StrategyRandom, Retries: &one, BanRules: []events.BanRule{{Name: "x", Status: []int{429}}}, Intercept: true,
			PerSite: &events.PerSite{Concurrency: 2, Rate: 1.5}, Session: &events.SessionRotation{MaxRequests: 10},
			Fallback: []string{"cheap", "premium"}, TierMemory: events.Duration(time.Hour)}}
	pub := spec.Public()
	if !pub.Gateway.Intercept || !spec.Gateway.Clone().Intercept {
		t.Errorf("intercept lost in the copy: %+v", pub.Gateway)
	}
	*pub.Gateway.Retries = 5
	pub.Gateway.BanRules[0].Status[0] = 403
	pub.Gateway.PerSite.Concurrency = 3
	pub.Gateway.Session.MaxRequests = 11
	pub.Gateway.Fallback[0] = "other"
	if spec.Gateway.Fallback[0] != "cheap" {
		t.Fatalf("Public shares the fallback list with the original: %q", spec.Gateway.Fallback)
	}
	if *spec.Gateway.Retries != 1 || spec.Gateway.BanRules[0].Status[0] != 429 || spec.Gateway.PerSite.Concurrency != 2 || spec.Gateway.Session.MaxRequests != 10 {
		t.Fatalf("Public shares the gateway spec with the original: %+v", spec.Gateway)
	}
	raw, back := jsonRoundTrip(t, spec.Public())
	if back.Gateway == nil || back.Gateway.Strategy != events.StrategyRandom || *back.Gateway.Retries != 1 || back.Gateway.BanRules[0].Status[0] != 429 || !back.Gateway.Intercept ||
		*back.Gateway.PerSite != (events.PerSite{Concurrency: 2, Rate: 1.5}) || *back.Gateway.Session != (events.SessionRotation{MaxRequests: 10}) {
		t.Errorf("round trip: %s", raw)
	}
	if !slices.Equal(back.Gateway.Fallback, []string{"cheap", "premium"}) || back.Gateway.TierMemoryOrDefault() != time.Hour || !strings.Contains(string(raw), `"fallback":["cheap","premium"],"tierMemory":"1h0m0s"`) {
		t.Errorf("round trip of fallback and tierMemory: %s", raw)
	}
	if (*events.GatewaySpec)(nil).TierMemoryOrDefault() != 10*time.Minute {
		t.Errorf("default tierMemory: %s", (*events.GatewaySpec)(nil).TierMemoryOrDefault())
	}
	if !strings.Contains(string(raw), `"intercept":true`) {
		t.Errorf("round trip: %s; want \"intercept\":true", raw)
	}
	if raw, _ := json.Marshal(events.GatewaySpec{Strategy: events.StrategyRandom}); strings.Contains(string(raw), "intercept") {
		t.Errorf("a gateway spec without interception writes the field: %s", raw)
	}
	if !strings.Contains(string(raw), `"perSite":{"concurrency":2,"rate":1.5}`) || !strings.Contains(string(raw), `"session":{"maxRequests":10}`) {
		t.Errorf("json names of perSite and session: %s", raw)
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

// TestPoolAutoscaleValidate: the pool's autoscale field is checked with
// the rest of the spec, each problem named under "autoscale".
func TestPoolAutoscaleValidate(t *testing.T) {
	cases := []struct {
		name string
		a    events.Autoscale
		want []string
	}{
		{"valid", events.Autoscale{Min: 2, Max: 10, TargetConnections: 4, ScaleDownAfter: events.Duration(10 * time.Second)}, nil},
		{"min 0", events.Autoscale{Min: 0, Max: 10, TargetConnections: 4}, []string{`autoscale.min: must be 1 or more (got "0")`}},
		{"max under min", events.Autoscale{Min: 5, Max: 4, TargetConnections: 4}, []string{`autoscale.max: must be at least min (got "4")`}},
		{"max too large", events.Autoscale{Min: 1, Max: events.MaxPoolSize + 1, TargetConnections: 4}, []string{`autoscale.max: must be at most 100000 (got "100001")`}},
		{"no target", events.Autoscale{Min: 1, Max: 2}, []string{`autoscale.targetConnections: must be 1 or more (got "0")`}},
		{"negative scaleDownAfter", events.Autoscale{Min: 1, Max: 2, TargetConnections: 1, ScaleDownAfter: events.Duration(-time.Second)},
			[]string{`autoscale.scaleDownAfter: must not be negative (got "-1s")`}},
		{"short scaleDownAfter", events.Autoscale{Min: 1, Max: 2, TargetConnections: 1, ScaleDownAfter: events.Duration(9 * time.Second)},
			[]string{`autoscale.scaleDownAfter: must be at least 10s (got "9s")`}},
	}
	for _, c := range cases {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 3, Autoscale: &c.a}
		spec.Normalize()
		if got := fieldMessages(t, c.name, spec.Validate()); !slices.Equal(got, c.want) {
			t.Errorf("%s: got %q, want %q", c.name, got, c.want)
		}
	}
}

// TestAutoscaleWant: one proxy per targetConnections, rounded up, within
// [min, max].
func TestAutoscaleWant(t *testing.T) {
	a := events.Autoscale{Min: 2, Max: 10, TargetConnections: 4}
	for _, c := range []struct{ conns, want int }{
		{0, 2}, {-1, 2}, {1, 2}, {8, 2}, {9, 3}, {12, 3}, {13, 4}, {37, 10}, {40, 10}, {41, 10}, {1 << 40, 10},
	} {
		if got := a.Want(c.conns); got != c.want {
			t.Errorf("Want(%d): got %d, want %d", c.conns, got, c.want)
		}
	}
	if a.ScaleDownAfterOrDefault() != events.DefaultScaleDownAfter {
		t.Errorf("default scaleDownAfter: got %s", a.ScaleDownAfterOrDefault())
	}
}

// TestSizeAfterApply: without autoscale a pool wants its size; with it,
// a first apply starts from size clamped into [min, max], a re-apply of
// an autoscaled pool keeps the current size clamped into the new bounds,
// and turning autoscale off returns to size.
func TestSizeAfterApply(t *testing.T) {
	auto := func(size, lo, hi int) events.PoolSpec {
		return events.PoolSpec{Name: "demo", Provider: "local", Size: size, Autoscale: &events.Autoscale{Min: lo, Max: hi, TargetConnections: 4}}
	}
	plain := events.PoolSpec{Name: "demo", Provider: "local", Size: 3}
	a2to10 := auto(3, 2, 10)
	cases := []struct {
		name string
		spec events.PoolSpec
		prev *events.PoolSpec
		cur  int
		want int
	}{
		{"plain, new", plain, nil, 0, 3},
		{"plain over autoscaled", plain, &a2to10, 9, 3},
		{"autoscaled, new", auto(3, 2, 10), nil, 0, 3},
		{"autoscaled, new, size under min", auto(1, 2, 10), nil, 0, 2},
		{"autoscaled, new, size over max", auto(30, 2, 10), nil, 0, 10},
		{"autoscaled over plain", auto(3, 2, 10), &plain, 7, 3},
		{"re-apply keeps the scaled size", auto(3, 2, 10), &a2to10, 9, 9},
		{"re-apply clamps to a lower max", auto(3, 2, 5), &a2to10, 9, 5},
		{"re-apply clamps to a higher min", auto(3, 6, 10), &a2to10, 2, 6},
	}
	for _, c := range cases {
		if got := c.spec.SizeAfterApply(c.prev, c.cur); got != c.want {
			t.Errorf("%s: got %d, want %d", c.name, got, c.want)
		}
	}
	if got := a2to10.SizeAfterScaled(12); got != 10 {
		t.Errorf("scaled beyond max: got %d, want 10", got)
	}
	if got := plain.SizeAfterScaled(7); got != 3 {
		t.Errorf("scaled event for a pool without autoscale: got %d, want its size 3", got)
	}
}

// TestAutoscaleRoundTrip: autoscale survives the public copy and JSON
// (it is in pool.applied), and the copy shares nothing.
func TestAutoscaleRoundTrip(t *testing.T) {
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 3,
		Autoscale: &events.Autoscale{Min: 2, Max: 10, TargetConnections: 4, ScaleDownAfter: events.Duration(time.Minute)}}
	pub := spec.Public()
	pub.Autoscale.Max = 99
	if spec.Autoscale.Max != 10 {
		t.Fatalf("Public shares autoscale with the original")
	}
	raw, back := jsonRoundTrip(t, spec.Public())
	if back.Autoscale == nil || *back.Autoscale != *spec.Autoscale {
		t.Errorf("round trip: %s", raw)
	}
	if !strings.Contains(string(raw), `"autoscale":{"min":2,"max":10,"targetConnections":4,"scaleDownAfter":"1m0s"}`) {
		t.Errorf("encoding: %s", raw)
	}
	if raw, _ := json.Marshal(events.PoolSpec{Name: "demo", Provider: "local"}); strings.Contains(string(raw), "autoscale") {
		t.Errorf("a spec without autoscale writes one: %s", raw)
	}
}

// TestPoolScaledData: a scaled event needs a size within the pool limits
// and a reason; only the planner may write one.
func TestPoolScaledData(t *testing.T) {
	cases := []struct {
		d    events.PoolScaledData
		want []string
	}{
		{events.PoolScaledData{Size: 10, Previous: 3, Reason: "autoscale: 37 connections for 10 proxies"}, nil},
		{events.PoolScaledData{Size: -1, Previous: events.MaxPoolSize + 1},
			[]string{`size: must be between 0 and 100000 (got "-1")`, `previous: must be between 0 and 100000 (got "100001")`, `reason: is required`}},
	}
	for _, c := range cases {
		if got := fieldMessages(t, fmt.Sprintf("%+v", c.d), c.d.Validate()); !slices.Equal(got, c.want) {
			t.Errorf("%+v: got %q, want %q", c.d, got, c.want)
		}
	}
	if got := events.Writers(events.AggregatePool, events.PoolScaled); !slices.Equal(got, []string{events.WriterPlanner}) {
		t.Errorf("writers of pool scaled: got %v, want planner only", got)
	}
	if fe := events.CheckEvent(events.AggregatePool, "demo", events.PoolScaled, events.SourceHealth, events.Observer{}); fe == nil || fe.Field != "source" {
		t.Errorf("a scaled event from health: got %v, want a source error", fe)
	}
	if got := events.EventSubject(events.AggregatePool, "demo", events.PoolScaled); got != "fleet.evt.pool.demo.scaled" {
		t.Errorf("subject: got %q", got)
	}
}

// TestBanRuleDefaults: each action has its own default threshold; a
// cooldown lasts 30m unless set; retireAfterSites is 3 within 1h unless
// set, and 0 disables it.
func TestBanRuleDefaults(t *testing.T) {
	for _, c := range []struct {
		rule      events.BanRule
		action    string
		threshold int
	}{
		{events.BanRule{}, events.BanActionRetire, events.DefaultBanThreshold},
		{events.BanRule{Action: events.BanActionCooldown}, events.BanActionCooldown, 1},
		{events.BanRule{Action: events.BanActionCooldown, Threshold: 4}, events.BanActionCooldown, 4},
		{events.BanRule{Action: events.BanActionRetry}, events.BanActionRetry, events.DefaultBanThreshold},
	} {
		if a, n := c.rule.ActionOrDefault(), c.rule.ThresholdOrDefault(); a != c.action || n != c.threshold {
			t.Errorf("%+v: action %q threshold %d; want %q %d", c.rule, a, n, c.action, c.threshold)
		}
	}
	if d := (events.BanRule{}).CooldownOrDefault(); d != 30*time.Minute {
		t.Errorf("default cooldown %s; want 30m", d)
	}
	var none *events.GatewaySpec
	zero := 0
	if n, w := none.RetireAfterSitesOrDefault(), none.RetireAfterSitesWindowOrDefault(); n != 3 || w != time.Hour {
		t.Errorf("default retireAfterSites %d within %s; want 3 within 1h", n, w)
	}
	g := &events.GatewaySpec{RetireAfterSites: &zero}
	c := g.Clone()
	zero = 5
	if n := c.RetireAfterSitesOrDefault(); n != 0 {
		t.Errorf("a cloned retireAfterSites 0 reads %d (or shares the original's pointer)", n)
	}
}

// TestCooldownKey: a site's dots and colons do not reach the key, which
// holds only what a KV key token may.
func TestCooldownKey(t *testing.T) {
	for site, want := range map[string]string{
		"example.co.uk": "p-a.ZXhhbXBsZS5jby51aw",
		"::1":           "p-a.Ojox",
	} {
		if got := events.CooldownKey("p-a", site); got != want {
			t.Errorf("CooldownKey(p-a, %q) = %q; want %q", site, got, want)
		}
	}
}
