package events_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestIdentifierRule(t *testing.T) {
	long := strings.Repeat("a", 63)
	cases := []struct {
		in   string
		want bool
	}{
		{"demo", true}, {"a", true}, {"kvm-home", true}, {"x1-2", true}, {long, true},
		{"", false}, {"-a", false}, {"a-", false}, {"A", false}, {"a.b", false},
		{"a_b", false}, {"a b", false}, {long + "a", false}, {"ä", false}, {"a*", false}, {"a>", false},
	}
	for _, c := range cases {
		if got := events.IsIdentifier(c.in); got != c.want {
			t.Errorf("IsIdentifier(%q) = %v, want %v", c.in, got, c.want)
		}
	}
}

func TestInstanceNameIsDeterministicAndValid(t *testing.T) {
	a, b := events.InstanceName("demo-abc"), events.InstanceName("demo-abc")
	if a != b {
		t.Fatalf("InstanceName not deterministic: %q vs %q", a, b)
	}
	if len(a) != 19 || !strings.HasPrefix(a, "px-") || !events.IsIdentifier(a) {
		t.Fatalf("InstanceName = %q: want px- + 16 lowercase base32 chars", a)
	}
	seen := map[string]string{}
	for i := 0; i < 10000; i++ {
		id := events.NewProxyID("pool")
		n := events.InstanceName(id)
		if prev, dup := seen[n]; dup {
			t.Fatalf("collision: %q and %q both give %q", prev, id, n)
		}
		seen[n] = id
	}
}

func TestNewProxyIDSatisfiesRule(t *testing.T) {
	for _, pool := range []string{"demo", strings.Repeat("p", 63), strings.Repeat("a", 51) + "-" + strings.Repeat("b", 11)} {
		id := events.NewProxyID(pool)
		if !events.IsIdentifier(id) {
			t.Errorf("NewProxyID(%q) = %q breaks the identifier rule", pool, id)
		}
	}
}

func TestSubjects(t *testing.T) {
	cases := map[string]string{
		events.APISubject("pool", "apply"):                                         "fleet.api.pool.apply",
		events.AgentSubject("local", "node1", events.AgentInfo):                    "fleet.agent.local.node1.info",
		events.GatewaySubject("gw1", events.GatewayInfo):                           "fleet.gateway.gw1.info",
		events.GatewayGroup("gw1"):                                                 "fleet.gateway.gw1",
		events.CommandSubject("kvm", "h1", events.VerbCreate):                      "fleet.cmd.kvm.h1.create",
		events.CommandFilter("kvm", "h1"):                                          "fleet.cmd.kvm.h1.>",
		events.EventSubject("proxy", "p1", "running"):                              "fleet.evt.proxy.p1.running",
		events.AggregateFilter("proxy", "p1"):                                      "fleet.evt.proxy.p1.>",
		events.ObservationSubject("p1", "running", "local", "t1"):                  "fleet.evt.proxy.p1.running.local.t1",
		events.ObservationFilter("p1", "running"):                                  "fleet.evt.proxy.p1.running.>",
		events.DecisionFilter("proxy", "p1"):                                       "fleet.evt.proxy.p1.*",
		events.AgentFilter("p1", "local", "t1"):                                    "fleet.evt.proxy.p1.*.local.t1",
		events.SubjectOf(events.AgentSource("kvm", "h1"), "proxy", "p1", "failed"): "fleet.evt.proxy.p1.failed.kvm.h1",
		events.SubjectOf(events.SourcePlanner, "proxy", "p1", "failed"):            "fleet.evt.proxy.p1.failed",
		events.SubjectOf(events.SourceHealth, "proxy", "p1", "ready"):              "fleet.evt.proxy.p1.ready",
		events.SubjectOf(events.SourcePlanner, "pool", "demo", "applied"):          "fleet.evt.pool.demo.applied",
	}
	for got, want := range cases {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
}

func TestParseEventSubject(t *testing.T) {
	tests := []struct {
		subject, agg, id, typ string
		by                    events.Observer
	}{
		{"fleet.evt.proxy.p1.running", "proxy", "p1", "running", events.Observer{}},
		{"fleet.evt.proxy.p1.running.local.t1", "proxy", "p1", "running", events.Observer{Entry: "local", Target: "t1"}},
		{events.SubjectOf(events.AgentSource("kvm", "h1"), "proxy", "p1", "deleted"), "proxy", "p1", "deleted", events.Observer{Entry: "kvm", Target: "h1"}},
		{"fleet.evt.pool.demo.applied", "pool", "demo", "applied", events.Observer{}},
		{"fleet.evt.planner.leader.term", "planner", "leader", "term", events.Observer{}},
	}
	for _, tt := range tests {
		agg, id, typ, by, ok := events.ParseEventSubject(tt.subject)
		if !ok || agg != tt.agg || id != tt.id || typ != tt.typ || by != tt.by {
			t.Errorf("ParseEventSubject(%q) = %q %q %q %v %v; want %q %q %q %v", tt.subject, agg, id, typ, by, ok, tt.agg, tt.id, tt.typ, tt.by)
		}
	}
	for _, bad := range []string{
		"fleet.evt.proxy.p1", "fleet.cmd.a.b.c", "fleet.evt.proxy..x", "fleet.evt.a.b.c.d",
		"fleet.evt.proxy.p1.running.local", "fleet.evt.proxy.p1.running.local.t1.x", "fleet.evt.proxy.p1.running..t1",
		"fleet.evt.pool.demo.applied.local.t1", "fleet.evt.proxy.p1.running.local.", "fleet.evt.", "fleet.evtx.proxy.p1.running",
	} {
		if _, _, _, _, ok := events.ParseEventSubject(bad); ok {
			t.Errorf("ParseEventSubject(%q) accepted a bad subject", bad)
		}
	}
}

func TestEnvelopeKeepsUnknownAttributesAndFields(t *testing.T) {
	in := `{"specversion":"1.0","id":"p.running.1","source":"s","type":"proxyfleet.proxy.running.v1",
	"time":"2026-01-02T03:04:05Z","futureattr":{"x":1},
	"data":{"address":"127.0.0.1:1","attempt":1,"newerField":"kept by the writer"}}`
	env, err := events.DecodeEnvelope([]byte(in))
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if string(env.Extensions["futureattr"]) != `{"x":1}` {
		t.Fatalf("extension lost: %v", env.Extensions)
	}
	var run events.ProxyRunningData
	if err := env.DecodeData(&run); err != nil {
		t.Fatalf("DecodeData with a newer field: %v", err)
	}
	if run.Address != "127.0.0.1:1" {
		t.Fatalf("address = %q", run.Address)
	}
	out, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"futureattr":{"x":1}`) || !strings.Contains(string(out), "newerField") {
		t.Fatalf("re-encoded envelope dropped unknown content: %s", out)
	}
}

func TestDecodeErrorsAreStructured(t *testing.T) {
	cases := []struct {
		name, in, want string
	}{
		{"not json", `{"specversion":`, "not valid JSON"},
		{"missing id", `{"specversion":"1.0","source":"s","type":"t"}`, "id: is required"},
		{"wrong version", `{"specversion":"0.3","id":"i","source":"s","type":"t"}`, "specversion"},
	}
	for _, c := range cases {
		_, err := events.DecodeEnvelope([]byte(c.in))
		var de *events.DecodeError
		if !errors.As(err, &de) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want a DecodeError containing %q", c.name, err, c.want)
		}
	}
	env, _ := events.NewEnvelope("i", "s", "t", "x", time.Now(), map[string]any{"address": 5})
	var run events.ProxyRunningData
	err := env.DecodeData(&run)
	if err == nil || !strings.Contains(err.Error(), `field "address"`) {
		t.Errorf("wrong type: got %v, want an error naming field address", err)
	}
	env, _ = events.NewEnvelope("i", "s", "t", "x", time.Now(), map[string]any{"attempt": 1})
	if err := env.DecodeData(&run); err == nil || !strings.Contains(err.Error(), "address") {
		t.Errorf("missing address: got %v, want a validation error", err)
	}
}

func TestPoolSpecValidation(t *testing.T) {
	ok := events.PoolSpec{Name: "demo", Provider: "local", Size: 3}
	ok.Normalize()
	if err := ok.Validate(); err != nil || ok.Port != events.DefaultProxyPort {
		t.Fatalf("valid spec: err %v, port %d", err, ok.Port)
	}
	cases := []struct {
		spec  events.PoolSpec
		field string
	}{
		{events.PoolSpec{Name: "Demo", Provider: "local"}, "name"},
		{events.PoolSpec{Name: "demo", Provider: ""}, "provider"},
		{events.PoolSpec{Name: "demo", Provider: "local", Size: -1}, "size"},
		{events.PoolSpec{Name: "demo", Provider: "local", Size: events.MaxPoolSize + 1}, "size"},
		{events.PoolSpec{Name: "demo", Provider: "local", Port: 70000}, "port"},
		{events.PoolSpec{Name: "demo", Provider: "local", Targets: []string{"ok", "Bad"}}, "targets[1]"},
		{events.PoolSpec{Name: "demo", Provider: "local", Image: "x.y"}, "image"},
		{events.PoolSpec{Name: "demo", Provider: "local", Auth: &events.ProxyAuth{Username: "a:b", Password: "p"}}, "auth.username"},
		{events.PoolSpec{Name: "demo", Provider: "local", Auth: &events.ProxyAuth{Username: "a"}}, "auth.password"},
		{events.PoolSpec{Name: "demo", Provider: "local", Auth: &events.ProxyAuth{Username: "a", Password: strings.Repeat("p", events.MaxPasswordBytes+1)}}, "auth.password"},
		{events.PoolSpec{Name: "demo", Provider: "local", MaxAge: events.Duration(time.Second)}, "maxAge"},
	}
	for _, c := range cases {
		err := c.spec.Validate()
		var ve *events.ValidationError
		if !errors.As(err, &ve) {
			t.Errorf("%+v: got %v, want a ValidationError", c.spec, err)
			continue
		}
		found := false
		for _, f := range ve.Fields {
			found = found || f.Field == c.field
		}
		if !found {
			t.Errorf("%+v: fields %+v do not name %q", c.spec, ve.Fields, c.field)
		}
	}
}

func TestPublicSpecHasNoSecrets(t *testing.T) {
	p := events.PoolSpec{Name: "demo", Provider: "local", UserData: "#cloud-config\nsecret", Auth: &events.ProxyAuth{Username: "u", Password: "hunter2"}}
	b, _ := json.Marshal(p.Public())
	if strings.Contains(string(b), "hunter2") || strings.Contains(string(b), "secret") {
		t.Fatalf("public spec leaks secrets: %s", b)
	}
	if p.Auth.Password != "hunter2" {
		t.Fatal("Public modified the original")
	}
	key := bytes.Repeat([]byte{7}, events.DigestKeyLen)
	s1, s2 := p.Secrets(), p.Secrets()
	if s1.Digest(key) == "" || s1.Digest(key) != s2.Digest(key) {
		t.Fatal("digest not stable")
	}
	if !s1.Matches(key, s1.Digest(key)) {
		t.Fatal("secrets do not match their own digest")
	}
	p.Auth.Password = "other"
	if p.Secrets().Digest(key) == s1.Digest(key) {
		t.Fatal("digest did not change with the password")
	}
	if p.Secrets().Matches(key, s1.Digest(key)) {
		t.Fatal("changed secrets match the old digest")
	}
}

// The digest is keyed: without the key, a reader of the log cannot test a
// guessed password against it, and it is not the bare SHA-256.
func TestSecretsDigestIsKeyed(t *testing.T) {
	s := events.PoolSecrets{Password: "hunter2"}
	k1 := bytes.Repeat([]byte{1}, events.DigestKeyLen)
	k2 := bytes.Repeat([]byte{2}, events.DigestKeyLen)
	if s.Digest(k1) == s.Digest(k2) {
		t.Fatal("the digest does not depend on the key")
	}
	bare := sha256.Sum256([]byte("hunter2"))
	framed := s.LegacyDigest()
	for _, d := range []string{s.Digest(k1), s.Digest(nil)} {
		if d == hex.EncodeToString(bare[:]) || d == framed {
			t.Fatalf("digest %s is an unkeyed hash of the password", d)
		}
	}
	// Digests older planners recorded still match, so their pools keep
	// working without a re-apply.
	if !s.Matches(k1, framed) {
		t.Fatal("the legacy digest is not accepted")
	}
	if (events.PoolSecrets{}).Matches(k1, framed) || s.Matches(k1, "") {
		t.Fatal("empty secrets or an empty digest matched")
	}
}

func TestDurationJSON(t *testing.T) {
	var d events.Duration
	if err := json.Unmarshal([]byte(`"72h"`), &d); err != nil || time.Duration(d) != 72*time.Hour {
		t.Fatalf("got %v, %v", d, err)
	}
	if err := json.Unmarshal([]byte(`5`), &d); err == nil {
		t.Fatal("a number was accepted as a duration")
	}
}
