package events_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// Fuzz targets of the decoders every reader of the event log runs on what
// it reads. `make fuzz` runs each; `go test` runs their seeds (below and in
// testdata/fuzz/<FuzzName>).

// envelopeSeeds are envelopes as services write them, plus odd shapes.
func envelopeSeeds(f *testing.F) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	for _, e := range []struct {
		id, source, typ, subject string
		data                     any
	}{
		{"px-1.running.1", events.AgentSource("local", "t1"), events.EnvelopeType(events.AggregateProxy, events.ProxyRunning), "px-1",
			events.ProxyRunningData{Address: "127.0.0.1:20000", Attempt: 1, ProviderID: "px-aaaa"}},
		{"px-1.requested.1", events.SourcePlanner, events.EnvelopeType(events.AggregateProxy, events.ProxyRequested), "px-1",
			events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: "px-aaaa", Revision: 1, Port: 3128}, Username: "u"}},
		{"demo.applied.2", events.SourcePlanner, events.EnvelopeType(events.AggregatePool, events.PoolApplied), "demo",
			events.PoolAppliedData{Revision: 2, Spec: events.PoolSpec{Name: "demo", Provider: "local", Size: 3, MaxAge: events.Duration(time.Hour)}}},
	} {
		env, err := events.NewEnvelope(e.id, e.source, e.typ, e.subject, at, e.data)
		if err != nil {
			f.Fatal(err)
		}
		env.SetLeader(7, "planner-a")
		b, err := json.Marshal(env)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, s := range []string{
		`{"specversion":"1.0","id":"i","source":"s","type":"t"}`,
		`{"specversion":"1.0","id":"i","source":"s","type":"t","time":"2026-01-02T03:04:05+01:00","data":{"a":"<&>"},"x":[1e400]}`,
		`{"specversion":"1.0","id":"a\u2028","source":"s","type":"t","data":null,"subject":null,"ID":"other"}`,
		"{\"specversion\":\"1.0\",\"id\":\"\xff\",\"source\":\"s\",\"type\":\"t\",\"\xfe\":\"\xfd\"}",
		`{"specversion":"1.0","id":"i","id":"j","source":"s","type":"t"}`,
		`{"specversion":"0.3","id":"i","source":"s","type":"t"}`,
		`null`, `[]`, `{}`, `{"time":"9999-12-31T23:59:59-23:59"}`,
	} {
		f.Add([]byte(s))
	}
}

// FuzzDecodeEnvelope: DecodeEnvelope refuses with a *DecodeError or returns
// a checked envelope; an envelope it returns encodes, and that encoding
// decodes to the same envelope and encodes to the same bytes again.
func FuzzDecodeEnvelope(f *testing.F) {
	envelopeSeeds(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := events.DecodeEnvelope(b)
		if err != nil {
			if de, ok := errors.AsType[*events.DecodeError](err); !ok || de.Reason == "" {
				t.Fatalf("DecodeEnvelope(%q) = %v; want a *DecodeError with a reason", b, err)
			}
			return
		}
		if e.SpecVersion != events.SpecVersion || e.ID == "" || e.Source == "" || e.Type == "" {
			t.Fatalf("DecodeEnvelope(%q) accepted %+v, which lacks a required attribute", b, e)
		}
		out, err := json.Marshal(e)
		if err != nil {
			t.Fatalf("a decoded envelope does not encode: %v\ninput %q", err, b)
		}
		again, err := events.DecodeEnvelope(out)
		if err != nil {
			t.Fatalf("the encoding %q of a decoded envelope does not decode: %v", out, err)
		}
		sameEnvelope(t, e, again)
		out2, err := json.Marshal(again)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, out2) {
			t.Fatalf("encoding is not stable:\n first %s\nsecond %s", out, out2)
		}
	})
}

// sameEnvelope fails unless a and b carry the same attributes: time as the
// same instant in the same offset, data and extensions as the same JSON
// values (re-encoding compacts and escapes them).
func sameEnvelope(t *testing.T, a, b events.Envelope) {
	t.Helper()
	if a.SpecVersion != b.SpecVersion || a.ID != b.ID || a.Source != b.Source || a.Type != b.Type ||
		a.Subject != b.Subject || a.DataContentType != b.DataContentType {
		t.Fatalf("attributes differ after a round trip:\n%+v\n%+v", a, b)
	}
	_, offA := a.Time.Zone()
	_, offB := b.Time.Zone()
	if !a.Time.Equal(b.Time) || offA != offB {
		t.Fatalf("time %v became %v", a.Time, b.Time)
	}
	if (len(a.Data) == 0) != (len(b.Data) == 0) || len(a.Data) > 0 && !sameJSON(a.Data, b.Data) {
		t.Fatalf("data %s became %s", a.Data, b.Data)
	}
	if len(a.Extensions) != len(b.Extensions) {
		t.Fatalf("extensions %v became %v", a.Extensions, b.Extensions)
	}
	for k, v := range a.Extensions {
		if w, ok := b.Extensions[k]; !ok || !sameJSON(v, w) {
			t.Fatalf("extension %q %s became %s", k, v, w)
		}
	}
}

// sameJSON reports whether a and b hold the same JSON value (numbers
// compared as written).
func sameJSON(a, b []byte) bool {
	va, errA := decodeNumbers(a)
	vb, errB := decodeNumbers(b)
	return errA == nil && errB == nil && reflect.DeepEqual(va, vb)
}

func decodeNumbers(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	err := d.Decode(&v)
	return v, err
}

// proxyData are a proxy event's data types by event type.
var proxyData = map[string]func() any{
	events.ProxyRequested:    func() any { return &events.ProxyRequestedData{} },
	events.ProxyProvisioning: func() any { return &events.ProxyProvisioningData{} },
	events.ProxyRunning:      func() any { return &events.ProxyRunningData{} },
	events.ProxyReady:        func() any { return &events.ProxyReadyData{} },
	events.ProxyUnhealthy:    func() any { return &events.ProxyUnhealthyData{} },
	events.ProxyFailed:       func() any { return &events.ProxyFailedData{} },
	events.ProxyRetiring:     func() any { return &events.ProxyRetiringData{} },
	events.ProxyDeleted:      func() any { return &events.ProxyDeletedData{} },
	events.ProxyAbandoned:    func() any { return &events.ProxyAbandonedData{} },
	events.ProxyDisabled:     func() any { return &events.ProxyDisabledData{} },
}

// FuzzProxyEventData: the data decoders of proxy events. Data that
// CheckProxyData accepts re-encodes to data it accepts and that decodes to
// the same value; ProxyView.Apply accepts exactly the data CheckProxyData
// accepts (for the types whose data it reads), and what it refuses leaves
// the view unchanged.
func FuzzProxyEventData(f *testing.F) {
	states := events.ProxyStates()
	for i, d := range []any{
		events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: "px-a", Revision: 1, Port: 3128}},
		events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: "px-a", ProviderID: "101", Attempt: 2},
		events.ProxyRunningData{Address: "10.0.0.5:3128", Attempt: 1},
		events.ProxyReadyData{Address: "10.0.0.5:3128", LatencyMS: 12, EgressIP: "203.0.113.7"},
		events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3},
		events.ProxyFailedData{Class: events.ClassQuota, Reason: "no room", Attempt: 1},
		events.ProxyRetiringData{Reason: "pool deleted", SkipCleanup: true},
		events.ProxyDeletedData{Attempt: 1},
		events.ProxyAbandonedData{Reason: "gone"},
		events.ProxyDisabledData{Until: time.Date(2026, 1, 2, 3, 14, 5, 0, time.UTC), Reason: "banned: captcha"},
	} {
		b, _ := json.Marshal(d)
		f.Add(uint8(i), b)
	}
	f.Add(uint8(1), []byte(`{"attempt":"1"}`))
	f.Add(uint8(2), []byte(`{"address":""}`))
	f.Add(uint8(0), []byte(`{"pool":"Demo","entry":"local","target":"t1","instance":"x"}`))
	f.Add(uint8(3), []byte(`{"latencyMs":1e3}`))
	f.Add(uint8(7), []byte(`[]`))
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		typ := states[int(which)%len(states)]
		env := events.Envelope{SpecVersion: events.SpecVersion, ID: "px-1." + typ + ".2", Source: "s",
			Type: events.EnvelopeType(events.AggregateProxy, typ), Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Data: data}
		checkErr := events.CheckProxyData(typ, env)
		if checkErr != nil {
			if _, ok := errors.AsType[*events.DecodeError](checkErr); !ok {
				t.Fatalf("CheckProxyData(%s, %q) = %v; want a *DecodeError", typ, data, checkErr)
			}
		}

		view := events.NewProxyView("px-1", "px-1.requested.1", 1, env.Time.Add(-time.Minute),
			events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: "px-a", Revision: 1, Port: 3128}})
		before := view
		applyErr := view.Apply(typ, 2, typ, env)
		readsData := typ != events.ProxyDeleted && typ != events.ProxyAbandoned
		switch {
		case checkErr == nil && applyErr != nil:
			t.Fatalf("Apply refused %s data %q that CheckProxyData accepts: %v", typ, data, applyErr)
		case readsData && checkErr != nil && applyErr == nil:
			t.Fatalf("Apply accepted %s data %q that CheckProxyData refuses (%v)", typ, data, checkErr)
		case applyErr != nil && !reflect.DeepEqual(view, before):
			t.Fatalf("Apply refused %q but changed the view:\n%+v\n%+v", data, before, view)
		}
		if checkErr != nil {
			return
		}

		d := proxyData[typ]()
		if err := json.Unmarshal(data, d); err != nil {
			t.Fatalf("CheckProxyData accepted %q, which does not decode: %v", data, err)
		}
		out, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		env.Data = out
		if err := events.CheckProxyData(typ, env); err != nil {
			t.Fatalf("%s data %q re-encoded as %s is refused: %v", typ, data, out, err)
		}
		d2 := proxyData[typ]()
		if err := json.Unmarshal(out, d2); err != nil || !reflect.DeepEqual(d, d2) {
			t.Fatalf("%s data %s decodes to %+v, %v; want %+v", typ, out, d2, err, d)
		}
	})
}

// FuzzParseEventSubject: a subject ParseEventSubject accepts is rebuilt
// by EventSubject (or ObservationSubject, for an agent's observation) to
// the same string, and a subject either builds from tokens without dots
// parses back to those tokens and that observer.
func FuzzParseEventSubject(f *testing.F) {
	f.Add(events.EventSubject(events.AggregateProxy, "demo-abc", events.ProxyRunning), "proxy", "demo-abc", "running", "", "")
	f.Add(events.ObservationSubject("demo-abc", events.ProxyRunning, "local", "t1"), "proxy", "demo-abc", "running", "local", "t1")
	f.Add(events.EventSubject(events.AggregatePool, "demo", events.PoolApplied), "pool", "demo", "applied", "", "")
	f.Add(events.PlannerTermSubject(), "planner", "", "term", "", "")
	f.Add("fleet.evt.proxy.a.b.c", "proxy", "a.b", "c", "x", "")
	f.Add("fleet.evt.pool.a.b.c.d", "pool", "a", "b", "c", "d")
	f.Add("fleet.evt..x.y", "", "x", "y", "", "")
	f.Add("fleet.evt.proxy.x.", "proxy", "x", "", "", "")
	f.Add("fleet.cmd.local.t1.create", "a", "*", ">", "", "")
	f.Add("fleet.evt.", " ", "\x00", "é", "", "")
	f.Fuzz(func(t *testing.T, subject, agg, id, typ, entry, target string) {
		if a, i, ty, by, ok := events.ParseEventSubject(subject); ok {
			if a == "" || i == "" || ty == "" || strings.Contains(a+i+ty+by.Entry+by.Target, ".") {
				t.Fatalf("ParseEventSubject(%q) = %q, %q, %q, %v: a token is empty or holds a dot", subject, a, i, ty, by)
			}
			got := events.EventSubject(a, i, ty)
			if !by.IsZero() {
				if a != events.AggregateProxy || by.Entry == "" || by.Target == "" {
					t.Fatalf("ParseEventSubject(%q) = %q, %q, %q, %v: an observer outside the proxy aggregate or with an empty token", subject, a, i, ty, by)
				}
				got = events.ObservationSubject(i, ty, by.Entry, by.Target)
			}
			if got != subject {
				t.Fatalf("ParseEventSubject(%q) = %q, %q, %q, %v, which rebuild to %q", subject, a, i, ty, by, got)
			}
		}
		clean := func(s ...string) bool {
			for _, x := range s {
				if x == "" || strings.Contains(x, ".") {
					return false
				}
			}
			return true
		}
		built := events.EventSubject(agg, id, typ)
		a, i, ty, by, ok := events.ParseEventSubject(built)
		// Tokens with dots may still form another valid subject (checked
		// above); clean tokens must parse back.
		if valid := clean(agg, id, typ); valid && !ok {
			t.Fatalf("ParseEventSubject(%q) ok = false; want true", built)
		}
		if ok && clean(agg, id, typ) && (a != agg || i != id || ty != typ || !by.IsZero()) {
			t.Fatalf("ParseEventSubject(%q) = %q, %q, %q, %v; want %q, %q, %q and no observer", built, a, i, ty, by, agg, id, typ)
		}
		obs := events.ObservationSubject(id, typ, entry, target)
		a, i, ty, by, ok = events.ParseEventSubject(obs)
		if valid := clean(id, typ, entry, target); valid && !ok {
			t.Fatalf("ParseEventSubject(%q) ok = false; want true", obs)
		}
		if ok && clean(id, typ, entry, target) && (a != events.AggregateProxy || i != id || ty != typ || by != (events.Observer{Entry: entry, Target: target})) {
			t.Fatalf("ParseEventSubject(%q) = %q, %q, %q, %v; want proxy, %q, %q, %s/%s", obs, a, i, ty, by, id, typ, entry, target)
		}
	})
}

// FuzzEventSource: the parser of an event's source (who wrote it).
// WriterOf names the agent role only for "proxyfleet/agent/<entry>/<target>"
// with two identifiers, so a source cannot pass for an agent's with a
// crafted name; and CheckEvent lets an event through only from one of its
// type's writers.
func FuzzEventSource(f *testing.F) {
	f.Add(events.AgentSource("local", "t1"), "local", "t1", "running")
	f.Add(events.SourcePlanner, "kvm", "host-1", "requested")
	f.Add(events.SourceHealth, "a", "b", "ready")
	f.Add("proxyfleet/agent/local/t1/extra", "local", "t1/x", "deleted")
	f.Add("proxyfleet/agent//t1", "", "t1", "failed")
	f.Add("proxyfleet/planner ", "Local", "t1", "applied")
	f.Fuzz(func(t *testing.T, source, entry, target, typ string) {
		w := events.WriterOf(source)
		switch w {
		case events.WriterPlanner:
			if source != events.SourcePlanner {
				t.Fatalf("WriterOf(%q) = planner", source)
			}
		case events.WriterHealth:
			if source != events.SourceHealth {
				t.Fatalf("WriterOf(%q) = health", source)
			}
		case events.WriterAgent:
			rest, _ := strings.CutPrefix(source, "proxyfleet/agent/")
			e, tg, _ := strings.Cut(rest, "/")
			if !events.IsIdentifier(e) || !events.IsIdentifier(tg) || events.AgentSource(e, tg) != source {
				t.Fatalf("WriterOf(%q) = agent, but it is not the source of an agent", source)
			}
		case "":
		default:
			t.Fatalf("WriterOf(%q) = %q, not a known writer", source, w)
		}
		want := ""
		if events.IsIdentifier(entry) && events.IsIdentifier(target) {
			want = events.WriterAgent
		}
		if got := events.WriterOf(events.AgentSource(entry, target)); got != want {
			t.Fatalf("WriterOf(AgentSource(%q, %q)) = %q; want %q", entry, target, got, want)
		}
		for _, agg := range []string{events.AggregateProxy, events.AggregatePool} {
			// The event on the subject its writer appends on (SubjectOf).
			var by events.Observer
			if b, ok := events.ParseAgentSource(source); ok && agg == events.AggregateProxy {
				by = b
			}
			fe := events.CheckEvent(agg, "px-1", typ, source, by)
			allowed := events.Writers(agg, typ)
			if allowed == nil {
				if fe != nil {
					t.Fatalf("CheckEvent(%s, %q, %q) = %v for a type with no writer list", agg, typ, source, fe)
				}
				continue
			}
			ok := w != "" && strings.Contains(","+strings.Join(allowed, ",")+",", ","+w+",")
			if (fe == nil) != ok {
				t.Fatalf("CheckEvent(%s, %q, source %q) = %v; writers are %v, the source is %q", agg, typ, source, fe, allowed, w)
			}
			if fe != nil && fe.Field != "source" {
				t.Fatalf("CheckEvent refusal names %q; want source", fe.Field)
			}
			// The same event on another agent's subject never passes.
			if other := (events.Observer{Entry: "other", Target: "elsewhere"}); agg == events.AggregateProxy && other != by {
				if fe := events.CheckEvent(agg, "px-1", typ, source, other); fe == nil {
					t.Fatalf("CheckEvent(%s, %q, source %q) on %s's subject passed", agg, typ, source, other)
				}
			}
		}
	})
}

// FuzzEventID: AttemptOf reads back the n of every id ProxyEventID builds,
// and is 1 or more for any id.
func FuzzEventID(f *testing.F) {
	f.Add("px-1.running.3", "px-1", "running", uint64(3))
	f.Add("px-1.requested.2.retry", "px-1", "requested", uint64(1))
	f.Add("px-1.running.-4", "px-1", "running", uint64(0))
	f.Add("px-1.running.99999999999999999999", "px-1", "running", uint64(1<<63))
	f.Fuzz(func(t *testing.T, id, proxy, typ string, n uint64) {
		if got := events.AttemptOf(id, proxy, typ); got < 1 {
			t.Fatalf("AttemptOf(%q, %q, %q) = %d; want 1 or more", id, proxy, typ, got)
		}
		if n < 1 || n > uint64(int(^uint(0)>>1)) {
			return
		}
		built := events.ProxyEventID(proxy, typ, n)
		if got := events.AttemptOf(built, proxy, typ); strconv.Itoa(got) != strconv.FormatUint(n, 10) {
			t.Fatalf("AttemptOf(%q, %q, %q) = %d; want %d", built, proxy, typ, got, n)
		}
	})
}

// FuzzCommandData: the data decoders agents run on FLEET_CMDS. A refusal
// is a *DecodeError; an accepted create or delete command re-encodes to
// data that is accepted and decodes to a command with the same encoding.
func FuzzCommandData(f *testing.F) {
	id := "demo-abc"
	for _, c := range []any{
		events.CreateCommand{
			ProxyID:   id,
			ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 2, Port: 3128},
			Attempt:   1,
			Auth:      &events.ProxyAuth{Username: "u", Password: "p"},
			UserData:  []byte("#cloud-config\n"),
		},
		events.DeleteCommand{ProxyID: id, Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName(id), ProviderID: "101", Attempt: 3, Reason: "retired"},
	} {
		b, _ := json.Marshal(c)
		f.Add(false, b)
		f.Add(true, b)
	}
	f.Add(false, []byte(`{"proxyID":"demo-abc","pool":"demo","entry":"local","target":"t1","instance":"px-x","attempt":1,"port":3128}`))
	f.Add(false, []byte(`{"userData":"not base64","port":70000,"attempt":0}`))
	f.Add(false, []byte(`{"proxyID":"demo-abc","pool":"demo","entry":"local","target":"t1","instance":"`+events.InstanceName(id)+`","attempt":1,"port":3128,"userData":"","auth":{}}`))
	f.Fuzz(func(t *testing.T, del bool, data []byte) {
		newCmd := func() any { return &events.CreateCommand{} }
		if del {
			newCmd = func() any { return &events.DeleteCommand{} }
		}
		env := events.Envelope{SpecVersion: events.SpecVersion, ID: "c", Source: events.SourcePlanner, Type: "t", Data: data}
		cmd := newCmd()
		if err := env.DecodeData(cmd); err != nil {
			if _, ok := errors.AsType[*events.DecodeError](err); !ok {
				t.Fatalf("DecodeData(%q) = %v; want a *DecodeError", data, err)
			}
			return
		}
		out, err := json.Marshal(cmd)
		if err != nil {
			t.Fatal(err)
		}
		env.Data = out
		again := newCmd()
		if err := env.DecodeData(again); err != nil {
			t.Fatalf("command %q re-encoded as %s is refused: %v", data, out, err)
		}
		// Empty and absent user-data are one on the wire (agents test its
		// length), so the commands are compared encoded.
		if out2, _ := json.Marshal(again); !bytes.Equal(out, out2) {
			t.Fatalf("command %s decodes to one that encodes as %s", out, out2)
		}
	})
}
