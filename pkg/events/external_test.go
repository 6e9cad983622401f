package events_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestParseUpstream(t *testing.T) {
	for _, c := range []struct {
		raw, addr, user, pass, err string
	}{
		{raw: "http://203.0.113.7:3128", addr: "203.0.113.7:3128"},
		{raw: "http://u:p%40ss@Proxy.Example.NET:8080/", addr: "proxy.example.net:8080", user: "u", pass: "p@ss"},
		{raw: "http://[2001:db8::1]:3128", addr: "[2001:db8::1]:3128"},
		{raw: "http://u@203.0.113.7:3128", addr: "203.0.113.7:3128", user: "u"},
		{raw: "https://203.0.113.7:3128", err: `scheme http (an HTTP proxy), not "https"`},
		{raw: "socks5://u:secret@203.0.113.7:1080", err: `not "socks5"`},
		{raw: "203.0.113.7:3128", err: "must be a URL such as http://"},
		{raw: "proxy.example.net:3128", err: `not "proxy.example.net"`},
		{raw: "http://203.0.113.7", err: "host and port"},
		{raw: "http://203.0.113.7:0", err: "port between 1 and 65535"},
		{raw: "http://203.0.113.7:3128/path", err: "path, query or fragment"},
		{raw: "http://203.0.113.7:3128?x=1", err: "path, query or fragment"},
		{raw: "http://:secret@203.0.113.7:3128", err: "without a username"},
		{raw: "http://%zz", err: "does not parse"},
	} {
		up, err := events.ParseUpstream(c.raw)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("ParseUpstream(%q) = %v; want an error containing %q", c.raw, err, c.err)
			}
			if err != nil && strings.Contains(err.Error(), "secret") {
				t.Errorf("ParseUpstream(%q)'s error quotes the password: %v", c.raw, err)
			}
			continue
		}
		if err != nil || up.Address != c.addr {
			t.Errorf("ParseUpstream(%q) = %+v, %v; want address %s", c.raw, up, err, c.addr)
			continue
		}
		switch {
		case c.user == "" && up.Auth != nil:
			t.Errorf("ParseUpstream(%q) has auth %+v; want none", c.raw, up.Auth)
		case c.user != "" && (up.Auth == nil || up.Auth.Username != c.user || up.Auth.Password != c.pass):
			t.Errorf("ParseUpstream(%q) auth = %+v; want %s/%s", c.raw, up.Auth, c.user, c.pass)
		}
	}
}

func externalPool(urls ...string) events.PoolSpec {
	x := &events.External{}
	for _, u := range urls {
		x.Proxies = append(x.Proxies, events.ExternalProxy{URL: u, Labels: map[string]string{"provider": "vendor-a"}})
	}
	return events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, External: x}
}

func TestExternalPoolValidation(t *testing.T) {
	ok := externalPool("http://u:secret1@203.0.113.7:3128", "http://203.0.113.8:3128")
	ok.Normalize()
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid external pool refused: %v", err)
	}
	if ok.Size != 2 {
		t.Errorf("Normalize left size %d; an external pool's size is its list (2)", ok.Size)
	}
	for _, c := range []struct {
		name  string
		spec  func() events.PoolSpec
		field string
	}{
		{"no list", func() events.PoolSpec {
			return events.PoolSpec{Name: "bought", Provider: events.ProviderExternal}
		}, "external"},
		{"empty list", func() events.PoolSpec {
			return events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, External: &events.External{}}
		}, "external"},
		{"external on another provider", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.Provider = "local"
			return s
		}, "external"},
		{"bad scheme", func() events.PoolSpec { return externalPool("https://u:secret1@203.0.113.7:3128") }, "external.proxies[0].url"},
		{"twice", func() events.PoolSpec {
			return externalPool("http://203.0.113.7:3128", "http://u:secret1@203.0.113.7:3128")
		}, "external.proxies[1].url"},
		{"bad label", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.External.Proxies[0].Labels = map[string]string{"Region": "eu"}
			return s
		}, "external.proxies[0].labels"},
		{"file and list", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.External.File = "/etc/proxyfleet/bought.txt"
			return s
		}, "external.file"},
		{"relative file", func() events.PoolSpec {
			return events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, External: &events.External{File: "bought.txt"}}
		}, "external.file"},
		{"short disableFor", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.External.DisableFor = events.Duration(time.Second)
			return s
		}, "external.disableFor"},
		{"size not the list", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.Size = 5
			return s
		}, "size"},
		{"image", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.Image = "debian"
			return s
		}, "image"},
		{"pool auth", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.Auth = &events.ProxyAuth{Username: "u", Password: "p"}
			return s
		}, "auth"},
		{"placement", func() events.PoolSpec {
			s := externalPool("http://203.0.113.7:3128")
			s.Placement = &events.Placement{Require: map[string][]string{"region": {"eu"}}}
			return s
		}, "placement"},
	} {
		spec := c.spec()
		err := spec.Validate()
		ve, ok := errors.AsType[*events.ValidationError](err)
		if !ok {
			t.Errorf("%s: Validate() = %v; want a *ValidationError naming %s", c.name, err, c.field)
			continue
		}
		found := false
		for _, p := range ve.Fields {
			found = found || p.Field == c.field
		}
		if !found {
			t.Errorf("%s: Validate() = %v; want a problem with field %q", c.name, err, c.field)
		}
		if strings.Contains(err.Error(), "secret1") {
			t.Errorf("%s: the error quotes a password: %v", c.name, err)
		}
	}
}

// The public spec (what the log records) carries no credentials; the
// secrets carry them by address, and they change the secrets digest.
func TestExternalCredentialsAreSecrets(t *testing.T) {
	spec := externalPool("http://alice:secret1@203.0.113.7:3128", "http://203.0.113.8:3128")
	raw, _ := json.Marshal(spec.Public())
	if strings.Contains(string(raw), "secret1") || strings.Contains(string(raw), "alice") {
		t.Fatalf("public spec carries credentials: %s", raw)
	}
	if !strings.Contains(string(raw), "http://203.0.113.7:3128") {
		t.Fatalf("public spec lost the proxy's address: %s", raw)
	}
	if err := (&events.PoolAppliedData{Revision: 1, Spec: spec.Public()}).Validate(); err != nil {
		t.Errorf("the recorded public spec does not validate: %v", err)
	}
	sec := spec.Secrets()
	if got := sec.External["203.0.113.7:3128"]; got.Username != "alice" || got.Password != "secret1" {
		t.Errorf("secrets of 203.0.113.7:3128 = %+v; want alice/secret1", got)
	}
	if _, ok := sec.External["203.0.113.8:3128"]; ok {
		t.Errorf("a proxy without credentials has secrets: %+v", sec.External)
	}
	key := make([]byte, events.DigestKeyLen)
	other := externalPool("http://alice:secret2@203.0.113.7:3128", "http://203.0.113.8:3128").Secrets()
	if sec.Digest(key) == "" || sec.Digest(key) == other.Digest(key) {
		t.Errorf("a changed external password leaves the secrets digest %q unchanged", sec.Digest(key))
	}
	// Secrets without external credentials digest as before they existed.
	plain := events.PoolSecrets{Password: "p"}
	if plain.Digest(key) != (events.PoolSecrets{Password: "p", External: map[string]events.ProxyAuth{}}).Digest(key) {
		t.Error("an empty external map changes the digest of a pool's secrets")
	}
}

func TestDisabledProxyView(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	v := events.NewProxyView("px-1", "px-1.requested.1", 1, at, events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "bought", Entry: events.ProviderExternal, Target: events.ProviderExternal, Instance: "px-1", Revision: 1, Port: 3128}})
	until := at.Add(10 * time.Minute)
	env := func(typ string, d any) events.Envelope {
		raw, _ := json.Marshal(d)
		return events.Envelope{ID: "px-1." + typ + ".1", Type: events.EnvelopeType(events.AggregateProxy, typ), Time: at, Data: raw}
	}
	steps := []struct {
		typ string
		d   any
	}{
		{events.ProxyRunning, events.ProxyRunningData{Address: "203.0.113.7:3128"}},
		{events.ProxyReady, events.ProxyReadyData{LatencyMS: 3}},
		{events.ProxyDisabled, events.ProxyDisabledData{Until: until, Reason: "banned: captcha"}},
	}
	for i, s := range steps {
		to, ok := events.Transition(v.State, s.typ)
		if !ok {
			t.Fatalf("Transition(%s, %s) refused", v.State, s.typ)
		}
		if err := v.Apply(to, uint64(i+2), s.typ, env(s.typ, s.d)); err != nil {
			t.Fatal(err)
		}
	}
	if v.State != events.ProxyDisabled || !v.DisabledUntil.Equal(until) || v.Reason != "banned: captcha" || !v.Probeable() {
		t.Fatalf("after disabled: %+v; want disabled until %v, its reason, probeable", v, until)
	}
	if to, ok := events.Transition(v.State, events.ProxyUnhealthy); ok || to != events.ProxyDisabled {
		t.Errorf("unhealthy moved a disabled proxy to %s", to)
	}
	if err := v.Apply(events.ProxyReady, 9, events.ProxyReady, env(events.ProxyReady, events.ProxyReadyData{LatencyMS: 4})); err != nil {
		t.Fatal(err)
	}
	if v.State != events.ProxyReady || !v.DisabledUntil.IsZero() || v.Reason != "" {
		t.Errorf("after ready: %+v; want ready, no disabledUntil, no reason", v)
	}
}

// The planner records the proxies it read from a pool's file with the
// file: a recorded spec may hold both, a requested one may not.
func TestRecordedFileWithItsProxies(t *testing.T) {
	spec := externalPool("http://203.0.113.7:3128")
	spec.External.File = "/etc/proxyfleet/bought.txt"
	spec.Normalize()
	if err := (&events.PoolAppliedData{Revision: 2, Spec: spec.Public()}).Validate(); err != nil {
		t.Errorf("a recorded spec with a file and its proxies does not validate: %v", err)
	}
	if err := spec.Validate(); err == nil {
		t.Error("a requested spec with a file and proxies validates")
	}
}
