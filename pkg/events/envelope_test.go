package events_test

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// Every attribute is read from its raw value exactly as a JSON decoder
// reads it: escapes, replacement of invalid UTF-8, null, raw data.
func TestDecodeEnvelopeAttributes(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	tests := []struct {
		name string
		in   string
		want events.Envelope
	}{
		{
			name: "plain",
			in:   `{"specversion":"1.0","id":"p.running.1","source":"s","type":"t","subject":"p","time":"2026-01-02T03:04:05.000006Z","datacontenttype":"application/json","data":{"a":1}}`,
			want: events.Envelope{SpecVersion: "1.0", ID: "p.running.1", Source: "s", Type: "t", Subject: "p", Time: at, DataContentType: "application/json", Data: json.RawMessage(`{"a":1}`)},
		},
		{
			name: "escapes",
			in:   `{"specversion":"1.0","id":"a\"b\\c\u00e9\ud83d\ude00","source":"s\/x","type":"t"}`,
			want: events.Envelope{SpecVersion: "1.0", ID: "a\"b\\cé😀", Source: "s/x", Type: "t"},
		},
		{
			name: "invalid UTF-8",
			in:   "{\"specversion\":\"1.0\",\"id\":\"a\xffb\",\"source\":\"s\",\"type\":\"t\"}",
			want: events.Envelope{SpecVersion: "1.0", ID: "a\ufffdb", Source: "s", Type: "t"},
		},
		{
			name: "nulls",
			in:   `{"specversion":"1.0","id":"i","source":"s","type":"t","subject":null,"time":null,"data":null}`,
			want: events.Envelope{SpecVersion: "1.0", ID: "i", Source: "s", Type: "t", Data: json.RawMessage(`null`)},
		},
		{
			name: "a repeated attribute replaces the earlier one, null included",
			in:   `{"specversion":"1.0","id":"i","source":"s","type":"t","subject":"x","time":"2026-01-02T03:04:05.000006Z","subject":null,"time":null,"id":"j"}`,
			want: events.Envelope{SpecVersion: "1.0", ID: "j", Source: "s", Type: "t"},
		},
		{
			name: "extensions",
			in:   `{"specversion":"1.0","id":"i","source":"s","type":"t","leaderterm":3,"ID":"other"}`,
			want: events.Envelope{SpecVersion: "1.0", ID: "i", Source: "s", Type: "t",
				Extensions: map[string]json.RawMessage{"leaderterm": json.RawMessage(`3`), "ID": json.RawMessage(`"other"`)}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := events.DecodeEnvelope([]byte(tt.in))
			if err != nil {
				t.Fatalf("DecodeEnvelope: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("DecodeEnvelope:\n got %+v\nwant %+v", got, tt.want)
			}
			var viaJSON events.Envelope
			if err := json.Unmarshal([]byte(tt.in), &viaJSON); err != nil || !reflect.DeepEqual(viaJSON, tt.want) {
				t.Fatalf("json.Unmarshal = %+v, %v; want %+v", viaJSON, err, tt.want)
			}
		})
	}
}

func TestDecodeEnvelopeRejectsWrongTypes(t *testing.T) {
	for _, in := range []string{
		`{"specversion":"1.0","id":5,"source":"s","type":"t"}`,
		`{"specversion":"1.0","id":"i","source":"s","type":"t","time":"yesterday"}`,
		`{"specversion":"1.0","id":"i","source":["s"],"type":"t"}`,
		`["specversion"]`,
		`{"specversion":"1.0","id":"i","source":"s","type":"t","data":{"a":}}`,
	} {
		_, err := events.DecodeEnvelope([]byte(in))
		var de *events.DecodeError
		if !errors.As(err, &de) {
			t.Errorf("DecodeEnvelope(%s) = %v; want a *DecodeError", in, err)
		}
	}
}

// referenceEnvelope decodes b the plain way, with one json.Unmarshal per
// attribute: what UnmarshalJSON's own scanning must agree with.
func referenceEnvelope(b []byte) (events.Envelope, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return events.Envelope{}, err
	}
	var e events.Envelope
	fields := map[string]any{
		"specversion": &e.SpecVersion, "id": &e.ID, "source": &e.Source, "type": &e.Type,
		"subject": &e.Subject, "datacontenttype": &e.DataContentType, "time": &e.Time,
	}
	for k, v := range m {
		switch f, ok := fields[k]; {
		case ok:
			if err := json.Unmarshal(v, f); err != nil {
				return events.Envelope{}, err
			}
		case k == "data":
			e.Data = v
		default:
			if e.Extensions == nil {
				e.Extensions = map[string]json.RawMessage{}
			}
			e.Extensions[k] = v
		}
	}
	return e, nil
}

func FuzzEnvelopeUnmarshalJSON(f *testing.F) {
	for _, seed := range []string{
		`{"specversion":"1.0","id":"p.running.1","source":"s","type":"t","time":"2026-01-02T03:04:05Z","data":{"a":[1,"}",{"b":null}]}}`,
		` { "id" : "a\"b" , "x\u0041" : [ "]" , 1.5e3 ] , "data" : "s" , "n" : -0 } `,
		`{"id":"i","id":"j","data":true,"subject":null}`,
		`{}`, `null`, `[]`, `"x"`, `{"id":5}`, `{"id":"\ud800"}`, "{\"id\":\"\xff\"}", `{"a":`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var got events.Envelope
		gotErr := got.UnmarshalJSON(b)
		want, wantErr := referenceEnvelope(b)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("UnmarshalJSON(%q) error %v; the reference decoder says %v", b, gotErr, wantErr)
		}
		if gotErr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("UnmarshalJSON(%q):\n got %+v\nwant %+v", b, got, want)
		}
	})
}

// BenchmarkDecodeEnvelope measures DecodeEnvelope of a typical proxy
// event against a baseline in the same run: one json.Unmarshal of the same
// bytes into a struct with the same fields (no extensions kept, no checks).
// It reports decode/baseline.
func BenchmarkDecodeEnvelope(b *testing.B) {
	data := events.ProxyRunningData{Address: "127.0.0.1:20000", Attempt: 1, ProviderID: "px-aaaaaaaaaaaaaaaa"}
	env, err := events.NewEnvelope("px-0000000000000001.running.1", events.AgentSource("local", "t1"),
		events.EnvelopeType(events.AggregateProxy, events.ProxyRunning), "px-0000000000000001", time.Now(), data)
	if err != nil {
		b.Fatal(err)
	}
	raw, err := env.MarshalJSON()
	if err != nil {
		b.Fatal(err)
	}
	// plain has Envelope's fields without its methods: encoding/json
	// decodes it field by field, keeping no extensions and checking nothing.
	type plain events.Envelope
	var base time.Duration
	b.Run("baseline", func(b *testing.B) {
		for b.Loop() {
			var p plain
			if err := json.Unmarshal(raw, &p); err != nil {
				b.Fatal(err)
			}
		}
		base = b.Elapsed() / time.Duration(b.N)
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			if _, err := events.DecodeEnvelope(raw); err != nil {
				b.Fatal(err)
			}
		}
		if base > 0 {
			b.ReportMetric(float64(b.Elapsed()/time.Duration(b.N))/float64(base), "decode/baseline")
		}
	})
}
