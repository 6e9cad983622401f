package decide

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

func externalSpec(urls ...string) events.PoolSpec {
	x := &events.External{DisableFor: events.Duration(5 * time.Minute)}
	for _, u := range urls {
		x.Proxies = append(x.Proxies, events.ExternalProxy{URL: u, Labels: map[string]string{"region": "eu"}})
	}
	return events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, Size: len(urls), External: x}
}

func extMember(id, state, addr string, port int) Proxy {
	return Proxy{ProxyView: events.ProxyView{ID: id, Pool: "bought", Entry: events.ProviderExternal, Target: events.ProviderExternal,
		State: state, Address: addr, Port: port, Labels: map[string]string{"region": "eu"}}}
}

func TestReconcileExternal(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	sick := extMember("b-2", events.ProxyUnhealthy, "198.51.100.2:8080", 8080)
	sick.UnhealthySince, sick.Reason = now.Add(-3*time.Minute), "connect refused"
	fresh := extMember("b-2", events.ProxyUnhealthy, "198.51.100.2:8080", 8080)
	fresh.UnhealthySince = now.Add(-30 * time.Second)
	relabelled := extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128)
	relabelled.Labels = map[string]string{"region": "us"}
	for _, c := range []struct {
		name    string
		spec    events.PoolSpec
		deleted bool
		members []Proxy
		want    []string // "<kind> <proxy or address>"
	}{
		{name: "new list: each listed proxy recorded",
			spec: externalSpec("http://u:p@198.51.100.1:3128", "http://198.51.100.2:8080"),
			want: []string{"list 198.51.100.1:3128", "list 198.51.100.2:8080"}},
		{name: "listed and running: nothing",
			spec:    externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128)}},
		{name: "unlisted: forgotten",
			spec: externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128),
				extMember("b-2", events.ProxyDisabled, "198.51.100.2:8080", 8080)},
			want: []string{"unlist b-2 unlisted"}},
		{name: "a crash after requested: its running, at the listed address of its port",
			spec: externalSpec("http://198.51.100.1:3128", "http://198.51.100.2:8080"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128),
				extMember("b-2", events.ProxyRequested, "", 8080)},
			want: []string{"run b-2 198.51.100.2:8080"}},
		{name: "a requested member nothing listed matches: forgotten",
			spec:    externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyRequested, "", 9999)},
			want:    []string{"unlist b-1 unlisted", "list 198.51.100.1:3128"}},
		{name: "a crash after retiring: its deleted",
			spec:    externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128), extMember("b-9", events.ProxyRetiring, "198.51.100.9:80", 80)},
			want:    []string{"forget b-9"}},
		{name: "labels changed: recorded anew",
			spec:    externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{relabelled},
			want:    []string{"unlist b-1 listed again with other labels", "list 198.51.100.1:3128"}},
		{name: "two members on one address: the second forgotten",
			spec: externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128),
				extMember("b-2", events.ProxyRunning, "198.51.100.1:3128", 3128)},
			want: []string{"unlist b-2 unlisted"}},
		{name: "unhealthy longer than unhealthyAfter: disabled, not replaced",
			spec:    externalSpec("http://198.51.100.2:8080"),
			members: []Proxy{sick},
			want:    []string{"disable b-2 unhealthy for 2m0s: connect refused"}},
		{name: "unhealthy a short while: kept",
			spec:    externalSpec("http://198.51.100.2:8080"),
			members: []Proxy{fresh}},
		{name: "a proxy an agent created, from before the pool was external: retired by its agent",
			spec: externalSpec("http://198.51.100.1:3128"),
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128),
				{ProxyView: events.ProxyView{ID: "o-1", Entry: "local", Target: "t1", State: events.ProxyReady, Address: "198.51.100.1:3128"}},
				{ProxyView: events.ProxyView{ID: "o-2", Entry: "local", Target: "t1", State: events.ProxyRetiring, UpdatedAt: now.Add(-time.Hour)}},
				{ProxyView: events.ProxyView{ID: "o-3", Entry: "local", Target: "t1", State: events.ProxyRetiring, UpdatedAt: now}}},
			want: []string{"retire o-1 the pool became external", "redelete o-2 "}},
		{name: "pool deleted: every member forgotten",
			spec: externalSpec("http://198.51.100.1:3128"), deleted: true,
			members: []Proxy{extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128)},
			want:    []string{"unlist b-1 pool deleted"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := &Input{Now: now, AgeNow: now, Config: Config{RetireTimeout: 3 * time.Minute}, Pool: Pool{Name: "bought", Spec: c.spec, Revision: 1, Deleted: c.deleted}, Members: c.members}
			plan := ReconcileExternal(in)
			var got []string
			for _, d := range plan.Decisions {
				s := d.Kind.String()
				switch d.Kind {
				case List:
					s += " " + d.Listed.Address
				case Run:
					s += " " + d.Proxy.ID + " " + d.Listed.Address
				case Forget:
					s += " " + d.Proxy.ID
				default:
					s += " " + d.Proxy.ID + " " + d.Reason
				}
				if d.Kind == Disable && !d.Until.Equal(now.Add(5*time.Minute)) {
					t.Errorf("disabled until %v; want now + disableFor", d.Until)
				}
				got = append(got, s)
			}
			if strings.Join(got, "; ") != strings.Join(c.want, "; ") {
				t.Errorf("decisions:\n got  %q\n want %q", got, c.want)
			}
			for _, d := range plan.Decisions {
				if (d.Kind == Create || d.Kind == Retire || d.Kind == Recreate || d.Kind == Redelete) && d.Proxy.Entry == events.ProviderExternal {
					t.Errorf("an owned pool's decision %s for an external proxy", d.Kind)
				}
			}
		})
	}
}

func TestListedOfKeepsPortAndLabels(t *testing.T) {
	spec := externalSpec("http://u:secret@[2001:db8::1]:3128", "http://proxy.example.net:8080")
	got := ListedOf(&spec)
	if len(got) != 2 || got[0].Address != "[2001:db8::1]:3128" || got[0].Port != 3128 || got[1].Port != 8080 || got[1].Labels["region"] != "eu" {
		t.Fatalf("ListedOf = %+v", got)
	}
}

func TestExternalConditions(t *testing.T) {
	until := time.Date(2026, 3, 1, 14, 5, 0, 0, time.UTC)
	a := extMember("b-1", events.ProxyReady, "198.51.100.1:3128", 3128)
	b := extMember("b-2", events.ProxyReady, "198.51.100.2:3128", 3128)
	d := extMember("b-3", events.ProxyDisabled, "198.51.100.3:3128", 3128)
	d.DisabledUntil, d.Reason = until, "banned: captcha"
	later := extMember("b-4", events.ProxyDisabled, "198.51.100.4:3128", 3128)
	later.DisabledUntil, later.Reason = until.Add(time.Hour), "banned: 403"
	for _, c := range []struct {
		name          string
		f             ExternalFound
		cooling       map[string]bool
		fileErr       string
		ready, placed string // "<status> <reason>: <message>"
		progressing   string
	}{
		{name: "the design's example",
			f: ExternalFound{Listed: 3, Usable: []Proxy{a, b}, Disabled: []Proxy{d}}, cooling: map[string]bool{"b-2": true},
			ready:       "True Usable: 3 listed: 2 usable (1 cooling on some site), 1 disabled until 14:05:00Z (banned: captcha)",
			placed:      "True Listed: every listed proxy is recorded (3)",
			progressing: "False Settled: the pool matches its list"},
		{name: "none usable: the earliest until",
			f:           ExternalFound{Listed: 3, Disabled: []Proxy{later, d}, Unhealthy: 1},
			ready:       "False NoneUsable: 3 listed: 0 usable, 2 disabled until 14:05:00Z (banned: captcha), 1 unhealthy",
			placed:      "True Listed: every listed proxy is recorded (3)",
			progressing: "False Settled: the pool matches its list"},
		{name: "recording, and a bad file",
			f: ExternalFound{Listed: 2, Pending: 2, Recording: 2, Leaving: 1}, fileErr: "line 3: must use scheme http (an HTTP proxy), not \"https\"",
			ready:       "False NoneUsable: 2 listed: 0 usable, 2 not yet probed",
			placed:      "False ExternalFileInvalid: external.file: line 3: must use scheme http (an HTTP proxy), not \"https\"; the list stays as the pool's last revision recorded it",
			progressing: "True Listing: recording the list: 2 to record, 1 to forget"},
	} {
		cs := ExternalConditions(&c.f, c.cooling, c.fileErr)
		show := func(d events.PoolConditionData) string { return d.Status + " " + d.Reason + ": " + d.Message }
		if len(cs) != 3 || show(cs[0]) != c.ready || show(cs[1]) != c.placed || show(cs[2]) != c.progressing {
			t.Errorf("%s:\n got  %q\n      %q\n      %q\n want %q\n      %q\n      %q", c.name, show(cs[0]), show(cs[1]), show(cs[2]), c.ready, c.placed, c.progressing)
		}
	}
}

func TestCheckUpstream(t *testing.T) {
	allow := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.1.0.0/16")}
	for _, c := range []struct {
		addr  string
		allow []netip.Prefix
		want  egress.Rule
	}{
		{"8.8.8.8", nil, egress.RuleOK},
		{"127.0.0.1", nil, egress.RuleLoopback},
		{"127.0.0.1", allow, egress.RuleOK},
		{"::ffff:127.0.0.1", allow, egress.RuleOK},
		{"169.254.169.254", allow, egress.RuleLinkLocal},
		{"10.1.2.3", allow, egress.RuleOK},
		{"10.2.0.1", allow, egress.RulePrivate},
		{"192.168.1.1", nil, egress.RulePrivate},
		{"::1", nil, egress.RuleLoopback},
		{"203.0.113.7", nil, egress.RuleReserved},
	} {
		if got := CheckUpstream(netip.MustParseAddr(c.addr), c.allow); got != c.want {
			t.Errorf("CheckUpstream(%s, %v) = %q; want %q", c.addr, c.allow, got, c.want)
		}
	}
}

func TestDisableBan(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	spec := externalSpec("http://198.51.100.1:3128")
	x := extMember("b-1", events.ProxyDisabled, "198.51.100.1:3128", 3128)
	x.DisabledUntil = now.Add(time.Minute)
	d := DisableBan(&Pool{Spec: spec}, x, "banned: captcha", now)
	if d.Kind != Disable || !d.Until.Equal(now.Add(5*time.Minute)) || d.Reason != "banned: captcha" {
		t.Errorf("DisableBan = %+v; want disable until now+5m, banned: captcha", d)
	}
	for s, want := range map[string]bool{events.ProxyReady: true, events.ProxyDisabled: true, events.ProxyUnhealthy: true,
		events.ProxyRequested: false, events.ProxyRetiring: false} {
		if got := CanDisable(extMember("b", s, "", 0)); got != want {
			t.Errorf("CanDisable(%s) = %v; want %v", s, got, want)
		}
	}
}
