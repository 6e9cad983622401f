package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/planner/internal/apiserver"
)

// loopbackAllowed is the allowance the tests' planners run with: their
// upstream proxies are on loopback, which the egress policy refuses.
var loopbackAllowed = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}

// testResolver answers from a table; a name it does not hold fails the
// test (no test resolves a name it did not mean to).
type testResolver struct {
	t     *testing.T
	names map[string][]netip.Addr
	calls atomic.Int64
}

func (r *testResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	r.calls.Add(1)
	if a, ok := r.names[host]; ok {
		return a, nil
	}
	r.t.Errorf("resolver asked for %q, which no test meant to resolve", host)
	return nil, errors.New("no such host")
}

// syncBuffer is a log sink tests read while the planner writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// externalLeader starts a leader for external pools: loopback allowed,
// the test's resolver, every log line (debug included) kept in logs.
func (h *harness) externalLeader(cfg Config, res *testResolver) (*running, *syncBuffer) {
	h.t.Helper()
	logs := &syncBuffer{}
	if cfg.ID == "" {
		cfg.ID = "p1"
	}
	if cfg.ExternalAllowCIDRs == nil {
		cfg.ExternalAllowCIDRs = loopbackAllowed
	}
	if res == nil {
		res = &testResolver{t: h.t}
	}
	cfg.Resolver = res
	r := h.startPlannerWith(cfg, nil, func(p *Planner) {
		p.log = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		// The API's own log lines (its refusals) too.
		api, err := apiserver.New(backend{p}, p.conn.NC, apiserver.Config{ID: p.cfg.ID, Log: p.log, Tracer: p.tracer, Meter: p.m.meter, Buckets: durationBuckets})
		if err != nil {
			h.t.Fatal(err)
		}
		p.api = api
	})
	h.waitFor("leader", r.IsLeader)
	return r, logs
}

// externalProxies returns the live proxies of pool by address.
func (h *harness) externalProxies(r *running, pool string) map[string]events.ProxyView {
	out := map[string]events.ProxyView{}
	for _, v := range (backend{r.Planner}).Proxies(pool, "", 1000) {
		if v.Address != "" {
			out[v.Address] = v
		}
	}
	return out
}

// waitExternal waits until pool holds exactly want (address -> state).
func (h *harness) waitExternal(r *running, pool string, want map[string]string) map[string]events.ProxyView {
	h.t.Helper()
	var got map[string]events.ProxyView
	h.waitFor(fmt.Sprintf("pool %s holds %v", pool, want), func() bool {
		got = h.externalProxies(r, pool)
		all := (backend{r.Planner}).Proxies(pool, "", 1000)
		if len(got) != len(want) || len(all) != len(want) {
			return false
		}
		for a, s := range want {
			if got[a].State != s {
				return false
			}
		}
		return true
	})
	return got
}

// rawEvents returns every message of FLEET_EVENTS as stored, bytes and
// headers.
func (h *harness) rawEvents() []byte {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		h.t.Fatal(err)
	}
	var out bytes.Buffer
	for seq := uint64(1); seq <= h.streamSeq(bus.EventsStream); seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			h.t.Fatal(err)
		}
		out.WriteString(m.Subject)
		for k, v := range m.Header {
			out.WriteString(k + strings.Join(v, ","))
		}
		out.Write(m.Data)
	}
	return out.Bytes()
}

// noCommands fails the test when FLEET_CMDS holds a message.
func (h *harness) noCommands() {
	h.t.Helper()
	if n := h.streamSeq(bus.CommandsStream); n != 0 {
		h.t.Errorf("FLEET_CMDS holds %d messages; nothing may be sent for an external pool", n)
	}
}

const (
	extPass1 = "s3cret-one"
	extPass2 = "s3cret-two"
)

// A listed proxy is recorded requested and running (as the external
// agent), an unlisted one retiring and deleted; nothing is ever sent to an
// agent; the credentials are in fleet-secrets and in no event or log line.
func TestExternalPoolListedAndUnlisted(t *testing.T) {
	h := newHarness(t)
	// Health and the gateway announce their keys: the credentials are
	// sealed to them.
	readers := map[string]nkeys.KeyPair{}
	for _, bucket := range []string{bus.BucketProbeCreds, bus.BucketGatewayCreds} {
		kv, err := h.c.JS.KeyValue(context.Background(), bucket)
		if err != nil {
			t.Fatal(err)
		}
		kp, _ := seal.NewKey()
		if _, err := kv.Put(context.Background(), events.ProbeRecipientKey, []byte(seal.Public(kp))); err != nil {
			t.Fatal(err)
		}
		readers[bucket] = kp
	}
	r, logs := h.externalLeader(Config{}, nil)
	body := `{"name":"bought","provider":"external","external":{"proxies":[
		{"url":"http://alice:` + extPass1 + `@127.0.0.1:3128","labels":{"region":"eu"}},
		{"url":"http://bob:` + extPass2 + `@127.0.0.2:8080","labels":{"region":"us"}},
		{"url":"http://127.0.0.3:3128"}]}}`
	h.ok(poolApply, body, nil)
	got := h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:8080": events.ProxyRunning, "127.0.0.3:3128": events.ProxyRunning})
	if v := got["127.0.0.2:8080"]; v.Entry != events.ProviderExternal || v.Target != events.ProviderExternal || v.Port != 8080 || v.Labels["region"] != "us" {
		t.Errorf("proxy of 127.0.0.2:8080 = %+v; want entry and target external, port 8080, region us", v)
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRunning) {
		if e.By != (events.Observer{Entry: events.ProviderExternal, Target: events.ProviderExternal}) || e.Source != events.AgentSource(events.ProviderExternal, events.ProviderExternal) {
			t.Errorf("running event of %s by %+v, source %s; want the external agent", e.ID, e.By, e.Source)
		}
	}
	if pv := r.poolView("bought"); pv.Size != 3 {
		t.Errorf("pool size %d; want 3 (its list)", pv.Size)
	}
	// The credentials are the pool's secrets, by address.
	e, err := h.secret.Get(context.Background(), "bought")
	if err != nil {
		t.Fatal(err)
	}
	var sec events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &sec); err != nil || sec.External["127.0.0.2:8080"] != (events.ProxyAuth{Username: "bob", Password: extPass2}) {
		t.Errorf("fleet-secrets holds %+v (%v); want bob's credentials by 127.0.0.2:8080", sec.External, err)
	}
	for bucket, kp := range readers {
		kv, _ := h.c.JS.KeyValue(context.Background(), bucket)
		h.waitFor("the credentials sealed in "+bucket, func() bool {
			s, err := h.probeCred(kv, kp, "bought")
			return err == nil && s.External["127.0.0.1:3128"] == (events.ProxyAuth{Username: "alice", Password: extPass1}) &&
				s.External["127.0.0.2:8080"] == (events.ProxyAuth{Username: "bob", Password: extPass2}) && len(s.External) == 2
		})
	}

	// Unlisted: 127.0.0.2 goes, 127.0.0.4 comes.
	body2 := `{"name":"bought","provider":"external","external":{"proxies":[
		{"url":"http://alice:` + extPass1 + `@127.0.0.1:3128","labels":{"region":"eu"}},
		{"url":"http://127.0.0.3:3128"},
		{"url":"http://127.0.0.4:3128"}]}}`
	h.ok(poolApply, body2, nil)
	h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.3:3128": events.ProxyRunning, "127.0.0.4:3128": events.ProxyRunning})
	gone := got["127.0.0.2:8080"].ID
	var kinds []string
	for _, e := range h.events() {
		if e.ID == gone {
			kinds = append(kinds, e.Kind)
			if e.Kind == events.ProxyDeleted && e.By.Entry != events.ProviderExternal {
				t.Errorf("deleted of %s by %+v; want the external agent", gone, e.By)
			}
			var d events.ProxyRetiringData
			if e.Kind == events.ProxyRetiring && (e.DecodeData(&d) != nil || d.Reason != "unlisted") {
				t.Errorf("retiring reason %q; want unlisted", d.Reason)
			}
		}
	}
	if strings.Join(kinds, ",") != "requested,running,retiring,deleted" {
		t.Errorf("events of the unlisted proxy: %v; want requested,running,retiring,deleted", kinds)
	}
	h.settle(r, 3)
	h.noCommands()
	for _, s := range []string{extPass1, extPass2} {
		if bytes.Contains(h.rawEvents(), []byte(s)) {
			t.Errorf("a credential is in FLEET_EVENTS")
		}
		if strings.Contains(logs.String(), s) {
			t.Errorf("a credential is in the planner's log")
		}
	}
	if !strings.Contains(logs.String(), "observed as the external agent") {
		t.Errorf("the log capture missed the planner's lines: %q", logs.String())
	}
}

// A crash between requested and running, or between retiring and
// deleted, is repaired by the next leader: the log alone says what is
// left to do.
func TestExternalCrashRepaired(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	spec := events.PoolSpec{Name: "bought", Provider: events.ProviderExternal, Size: 2, External: &events.External{Proxies: []events.ExternalProxy{
		{URL: "http://127.0.0.1:3128", Labels: map[string]string{"region": "eu"}}, {URL: "http://127.0.0.2:3128"}}}}
	if _, err := h.store.Append(ctx, events.AggregatePool, "bought", events.PoolApplied, "bought.applied.1", events.PoolAppliedData{Spec: spec, Revision: 1}, &bus.Expect{Seq: 0}); err != nil {
		t.Fatal(err)
	}
	req := func(id string, port int, labels map[string]string) {
		d := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "bought", Entry: events.ProviderExternal, Target: events.ProviderExternal,
			Instance: events.InstanceName(id), Revision: 1, Port: port}, Labels: labels}
		if _, err := h.store.Append(ctx, events.AggregateProxy, id, events.ProxyRequested, events.ProxyEventID(id, events.ProxyRequested, 1), d, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
	}
	// Requested, its running never stored.
	half := events.NewProxyID("bought")
	req(half, 3128, map[string]string{"region": "eu"})
	// Unlisted long ago: retiring, its deleted never stored.
	leaving := events.NewProxyID("bought")
	req(leaving, 9999, nil)
	ext := bus.NewEventStore(h.c, events.AgentSource(events.ProviderExternal, events.ProviderExternal), nil)
	if _, err := ext.Append(ctx, events.AggregateProxy, leaving, events.ProxyRunning, events.ProxyEventID(leaving, events.ProxyRunning, 1), events.ProxyRunningData{Address: "127.0.0.9:9999", Attempt: 1}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := h.store.Append(ctx, events.AggregateProxy, leaving, events.ProxyRetiring, "x", events.ProxyRetiringData{Reason: "unlisted"}, nil); err != nil {
		t.Fatal(err)
	}
	r, _ := h.externalLeader(Config{}, nil)
	got := h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:3128": events.ProxyRunning})
	if got["127.0.0.1:3128"].ID != half {
		t.Errorf("127.0.0.1:3128 is %s; want the half-recorded %s, given its running", got["127.0.0.1:3128"].ID, half)
	}
	h.waitFor("the retiring proxy deleted", func() bool {
		x, aerr := r.lookupProxy(ctx, leaving)
		return aerr == nil && x.State == events.ProxyDeleted
	})
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 3 {
		t.Errorf("%d requested events; want 3 (the two seeded, one for 127.0.0.2)", n)
	}
	h.noCommands()
}

// A reported ban disables an external proxy for disableFor (a second ban
// extends it), never retires or replaces it; proxy.delete and recycle are
// refused.
func TestExternalBanDisables(t *testing.T) {
	h := newHarness(t)
	r, _ := h.externalLeader(Config{}, nil)
	h.ok(poolApply, `{"name":"bought","provider":"external","external":{"disableFor":"10m","proxies":[{"url":"http://u:`+extPass1+`@127.0.0.1:3128"},{"url":"http://127.0.0.2:3128"}]}}`, nil)
	got := h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:3128": events.ProxyRunning})
	id := got["127.0.0.1:3128"].ID
	h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{LatencyMS: 3})
	h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyReady, "127.0.0.2:3128": events.ProxyRunning})

	before := time.Now()
	var v events.ProxyView
	h.ok(proxyReportBan, `{"id":"`+id+`","reason":"captcha"}`, &v)
	if v.State != events.ProxyDisabled || v.Reason != "banned: captcha" || v.DisabledUntil.Before(before.Add(10*time.Minute-time.Second)) {
		t.Fatalf("after a ban: %s %q until %v; want disabled, banned: captcha, until ~now+10m", v.State, v.Reason, v.DisabledUntil)
	}
	first := v.DisabledUntil
	time.Sleep(20 * time.Millisecond)
	h.ok(proxyReportBan, `{"id":"`+id+`","reason":"403"}`, &v)
	if v.State != events.ProxyDisabled || !v.DisabledUntil.After(first) || v.Reason != "banned: 403" {
		t.Errorf("a ban while disabled: %s %q until %v; want disabled, banned: 403, until after %v", v.State, v.Reason, v.DisabledUntil, first)
	}
	for _, c := range []struct{ subject, body string }{
		{proxyDelete, `{"id":"` + id + `"}`},
		{proxyRecycle, `{"id":"` + id + `"}`},
		{proxyRecycle, `{"id":"` + id + `","now":true}`},
	} {
		h.changesNothing(t, func() {
			rep := h.request(c.subject, c.body, nil)
			if rep.Error == nil || !hasField(rep.Error, "id") || !strings.Contains(rep.Body2(), "external proxy") {
				t.Errorf("%s %s: %s %s; want a 422 naming id, an external proxy", c.subject, c.body, rep.Code, rep.Body)
			}
		})
	}
	h.settle(r, 3)
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 2 {
		t.Errorf("%d requested events; a ban must not replace an external proxy", n)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)); n != 0 {
		t.Errorf("%d retiring events; a ban must not retire an external proxy", n)
	}
	if x, _ := r.lookupProxy(context.Background(), id); x.State != events.ProxyDisabled {
		t.Errorf("state %s; want disabled", x.State)
	}
	h.noCommands()
}

// Body2 is the reply's body as text.
func (r reply) Body2() string { return string(r.Body) }

// A member unhealthy for longer than unhealthyAfter is disabled, not
// replaced.
func TestExternalUnhealthyDisabled(t *testing.T) {
	h := newHarness(t)
	var skew atomic.Int64
	r := h.skewedLeader("p1", &skew, Config{ExternalAllowCIDRs: loopbackAllowed, Resolver: &testResolver{t: t}})
	h.ok(poolApply, `{"name":"bought","provider":"external","unhealthyAfter":"1m","external":{"proxies":[{"url":"http://127.0.0.1:3128"}]}}`, nil)
	got := h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning})
	id := got["127.0.0.1:3128"].ID
	h.observe(id, events.ProxyReady, 1, events.ProxyReadyData{LatencyMS: 3})
	h.observe(id, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "connect refused", Streak: 3})
	h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyUnhealthy})
	h.settle(r, 2)
	if x, _ := r.lookupProxy(context.Background(), id); x.State != events.ProxyUnhealthy {
		t.Fatalf("disabled before unhealthyAfter: %s", x.State)
	}
	skew.Store(int64(2 * time.Minute))
	r.poke()
	h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyDisabled})
	x, _ := r.lookupProxy(context.Background(), id)
	if x.Reason != "unhealthy for 1m0s: connect refused" || x.DisabledUntil.IsZero() {
		t.Errorf("disabled with reason %q until %v; want unhealthy for 1m0s: connect refused, a time", x.Reason, x.DisabledUntil)
	}
	if n := len(h.eventsOf(events.AggregateProxy, events.ProxyRequested)); n != 1 {
		t.Errorf("%d requested events; an unhealthy external proxy is never replaced", n)
	}
	h.noCommands()
}

// An upstream address the egress policy refuses is refused at apply with
// its field path, hostnames resolved (through the planner's resolver) and
// checked; nothing is appended, and no credential is in the answer.
func TestExternalApplyRefusesForbiddenAddresses(t *testing.T) {
	h := newHarness(t)
	res := &testResolver{t: t, names: map[string][]netip.Addr{
		"proxy.inside.test":  {netip.MustParseAddr("8.8.8.8"), netip.MustParseAddr("10.0.0.7")},
		"proxy.outside.test": {netip.MustParseAddr("8.8.4.4")},
	}}
	h.externalLeader(Config{ExternalAllowCIDRs: []netip.Prefix{}}, res)
	for _, c := range []struct{ name, url, field, want string }{
		{"loopback", "http://u:" + extPass1 + "@127.0.0.1:3128", "external.proxies[1].url", "loopback"},
		{"metadata", "http://169.254.169.254:80", "external.proxies[1].url", "link-local"},
		{"a name resolving to a private address", "http://u:" + extPass1 + "@proxy.inside.test:3128", "external.proxies[1].url", "resolves to 10.0.0.7"},
		{"bad scheme", "https://u:" + extPass1 + "@proxy.outside.test:3128", "external.proxies[1].url", "scheme http"},
	} {
		t.Run(c.name, func(t *testing.T) {
			body := `{"name":"bought","provider":"external","external":{"proxies":[{"url":"http://proxy.outside.test:3128"},{"url":"` + c.url + `"}]}}`
			h.changesNothing(t, func() {
				rep := h.request(poolApply, body, nil)
				if rep.Error == nil || !hasField(rep.Error, c.field) || !strings.Contains(string(rep.Body), c.want) {
					t.Errorf("apply: %s %s; want a 422 naming %s, saying %q", rep.Code, rep.Body, c.field, c.want)
				}
				if strings.Contains(string(rep.Body), extPass1) {
					t.Errorf("the refusal quotes a credential: %s", rep.Body)
				}
			})
			if _, err := h.secret.Get(context.Background(), "bought"); !errors.Is(err, jetstream.ErrKeyNotFound) {
				t.Errorf("a refused apply left secrets behind: %v", err)
			}
		})
	}
	if res.calls.Load() == 0 {
		t.Error("no hostname was resolved")
	}
}

// A file of proxies is read at apply (a bad one refused with its line)
// and watched: a change becomes a new revision; a file that turns bad
// leaves the list as it was and turns Placed False.
func TestExternalFile(t *testing.T) {
	h := newHarness(t)
	r, logs := h.externalLeader(Config{ExternalFileInterval: 100 * time.Millisecond}, nil)
	path := filepath.Join(t.TempDir(), "bought.txt")
	write := func(s string) {
		t.Helper()
		// Written aside and renamed, as an operator's tools do, so a read
		// never sees half a file.
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	body := `{"name":"filed","provider":"external","external":{"file":"` + path + `"}}`
	write("# bought\nhttp://alice:" + extPass1 + "@127.0.0.1:3128 region=eu\n\nhttps://bob:" + extPass2 + "@127.0.0.2:3128\n")
	h.changesNothing(t, func() {
		rep := h.request(poolApply, body, nil)
		if rep.Error == nil || !hasField(rep.Error, "external.file") || !strings.Contains(string(rep.Body), "line 4") {
			t.Errorf("apply of a bad file: %s %s; want a 422 naming external.file, line 4", rep.Code, rep.Body)
		}
		if strings.Contains(string(rep.Body), extPass2) {
			t.Errorf("the refusal quotes a credential: %s", rep.Body)
		}
	})
	write("# bought\nhttp://alice:" + extPass1 + "@127.0.0.1:3128 region=eu\n\nhttp://bob:" + extPass2 + "@127.0.0.2:3128\n")
	h.ok(poolApply, body, nil)
	got := h.waitExternal(r, "filed", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:3128": events.ProxyRunning})
	if got["127.0.0.1:3128"].Labels["region"] != "eu" {
		t.Errorf("labels of the file's first proxy: %v", got["127.0.0.1:3128"].Labels)
	}
	// A change: a proxy added, one's password changed.
	write("http://alice:" + extPass1 + "@127.0.0.1:3128 region=eu\nhttp://bob:new-" + extPass2 + "@127.0.0.2:3128\nhttp://127.0.0.3:3128\n")
	h.waitExternal(r, "filed", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:3128": events.ProxyRunning, "127.0.0.3:3128": events.ProxyRunning})
	h.waitFor("the new password in fleet-secrets", func() bool {
		e, err := h.secret.Get(context.Background(), "filed")
		var sec events.PoolSecrets
		return err == nil && json.Unmarshal(e.Value(), &sec) == nil && sec.External["127.0.0.2:3128"].Password == "new-"+extPass2
	})
	rev := r.poolView("filed").Revision
	if rev < 2 {
		t.Errorf("revision %d after the file changed; want a new one", rev)
	}
	// Turns bad: the list stays, Placed says why.
	write("http://127.0.0.1:3128 region=eu\nhttp://u:" + extPass1 + "@127.0.0.5\n")
	h.waitFor("Placed False, ExternalFileInvalid", func() bool {
		c, ok := events.FindCondition(r.poolView("filed").Conditions, events.ConditionPlaced)
		return ok && c.Status == events.ConditionFalse && c.Reason == "ExternalFileInvalid" && strings.Contains(c.Message, "line 2")
	})
	if pv := r.poolView("filed"); pv.Revision != rev || len(h.externalProxies(r, "filed")) != 3 {
		t.Errorf("a bad file changed the pool: revision %d (want %d), %d proxies (want 3)", pv.Revision, rev, len(h.externalProxies(r, "filed")))
	}
	// Good again: Placed True.
	write("http://127.0.0.1:3128 region=eu\n")
	h.waitExternal(r, "filed", map[string]string{"127.0.0.1:3128": events.ProxyRunning})
	h.waitFor("Placed True", func() bool {
		c, ok := events.FindCondition(r.poolView("filed").Conditions, events.ConditionPlaced)
		return ok && c.Status == events.ConditionTrue
	})
	h.noCommands()
	if !strings.Contains(logs.String(), "request refused") {
		t.Errorf("the log capture missed the API's refusal of the bad file")
	}
	for _, s := range []string{extPass1, extPass2} {
		if bytes.Contains(h.rawEvents(), []byte(s)) {
			t.Errorf("a credential of the file is in FLEET_EVENTS")
		}
		if strings.Contains(logs.String(), s) {
			t.Errorf("a credential of the file is in the planner's log")
		}
	}
}

// The conditions of an external pool count usable, cooling, disabled and
// unhealthy members.
func TestExternalConditions(t *testing.T) {
	h := newHarness(t)
	r, _ := h.externalLeader(Config{}, nil)
	h.ok(poolApply, `{"name":"bought","provider":"external","external":{"proxies":[{"url":"http://127.0.0.1:3128"},{"url":"http://127.0.0.2:3128"},{"url":"http://127.0.0.3:3128"}]}}`, nil)
	got := h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyRunning, "127.0.0.2:3128": events.ProxyRunning, "127.0.0.3:3128": events.ProxyRunning})
	for _, x := range got {
		h.observe(x.ID, events.ProxyReady, 1, events.ProxyReadyData{LatencyMS: 3})
	}
	h.waitExternal(r, "bought", map[string]string{"127.0.0.1:3128": events.ProxyReady, "127.0.0.2:3128": events.ProxyReady, "127.0.0.3:3128": events.ProxyReady})
	// One cools on a site (a gateway's shared cooldown), one is banned.
	kv, err := h.c.JS.KeyValue(context.Background(), bus.BucketGatewayCooldowns)
	if err != nil {
		t.Fatal(err)
	}
	cool := got["127.0.0.2:3128"].ID
	now := time.Now().UTC()
	b, _ := json.Marshal(events.GatewayCooldown{Proxy: cool, Pool: "bought", Site: "example.com", Rule: "429", Gateway: "gw-1", At: now, Until: now.Add(5 * time.Minute)})
	if _, err := kv.Put(context.Background(), events.CooldownKey(cool, "example.com"), b); err != nil {
		t.Fatal(err)
	}
	var v events.ProxyView
	h.ok(proxyReportBan, `{"id":"`+got["127.0.0.3:3128"].ID+`","reason":"captcha"}`, &v)
	want := "3 listed: 2 usable (1 cooling on some site), 1 disabled until " + v.DisabledUntil.UTC().Format("15:04:05Z") + " (banned: captcha)"
	h.waitFor("Ready counts usable, cooling and disabled", func() bool {
		c, ok := events.FindCondition(r.poolView("bought").Conditions, events.ConditionReady)
		return ok && c.Status == events.ConditionTrue && c.Message == want
	})
}

// A pool that changes between owned and external keeps the rule that
// matters for each proxy: one an agent created is retired and deleted by
// its agent (a delete command), an external one is only forgotten (no
// command for entry external, ever).
func TestExternalProviderChange(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r, _ := h.externalLeader(Config{}, nil)
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ := h.requested(1)
	owned := ids[0]
	h.bringUp(owned, "t1", events.ProxyReady)
	h.waitState(r, owned, events.ProxyReady)

	h.ok(poolApply, `{"name":"demo","provider":"external","external":{"proxies":[{"url":"http://127.0.0.1:3128"}]}}`, nil)
	h.waitState(r, owned, events.ProxyRetiring)
	h.waitFor("the owned proxy's delete sent to its agent", func() bool {
		for _, c := range h.commandsOf(events.VerbDelete) {
			if c.Delete.ProxyID == owned && c.Delete.Entry == "local" {
				return true
			}
		}
		return false
	})
	h.observe(owned, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	got := h.waitExternal(r, "demo", map[string]string{"127.0.0.1:3128": events.ProxyRunning})
	ext := got["127.0.0.1:3128"].ID

	// Back to owned: a roll; the external proxy is forgotten once its
	// owned replacement is ready.
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	ids, _ = h.requested(3)
	h.bringUp(ids[2], "t1", events.ProxyReady)
	h.waitFor("the external proxy forgotten", func() bool {
		x, aerr := r.lookupProxy(context.Background(), ext)
		return aerr == nil && x.State == events.ProxyDeleted
	})
	var kinds []string
	for _, e := range h.events() {
		if e.ID == ext {
			kinds = append(kinds, e.Kind+"/"+e.By.Entry)
		}
	}
	if strings.Join(kinds, ",") != "requested/,running/external,retiring/,deleted/external" {
		t.Errorf("events of the external proxy: %v; want it requested, running, retiring and deleted, the observations as the external agent", kinds)
	}
	for _, c := range h.commands() {
		if strings.HasPrefix(c.Subject, "fleet.cmd."+events.ProviderExternal+".") {
			t.Errorf("a command for entry external: %s", c.Subject)
		}
	}
}
