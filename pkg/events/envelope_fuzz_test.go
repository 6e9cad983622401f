package events

import (
	"encoding/json"
	"reflect"
	"testing"
)

// unmarshalBothWays is Envelope.UnmarshalJSON without the shortcut for
// envelopes that carry only known attributes.
func unmarshalBothWays(b []byte) (Envelope, error) {
	type plain Envelope
	var p plain
	if err := json.Unmarshal(b, &p); err != nil {
		return Envelope{}, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return Envelope{}, err
	}
	for k, v := range m {
		if !knownAttrs[k] {
			if p.Extensions == nil {
				p.Extensions = map[string]json.RawMessage{}
			}
			p.Extensions[k] = v
		}
	}
	return Envelope(p), nil
}

// FuzzEnvelopeShortcut: the shortcut taken for envelopes with known
// attributes only decodes every input as the full decode does.
func FuzzEnvelopeShortcut(f *testing.F) {
	for _, s := range []string{
		`{"specversion":"1.0","id":"p.running.1","source":"s","type":"proxyfleet.proxy.running.v1","time":"2026-01-02T03:04:05Z","data":{"address":"127.0.0.1:1","attempt":1}}`,
		`{"specversion":"1.0","id":"x","futureattr":{"x":[1,"}",{"y":"\""}]},"data":[]}`,
		` { "id" : "a\"b" , "data" : { "k" : [ true , null , -1.5e3 ] } , "subject":"s" } `,
		`{"ID":"x","id":"y"}`, `{"i\u0064":"x"}`, `{}`, `[]`, `null`, `"x"`, `{"data":"}"}`, `{"data":{"a":"]"},"x":1}`,
		`{"data":1,"time":"2026-01-02T03:04:05Z"}`, `{"data":{"a":{"b":{}}},"id":"x"}`, `{"id":"x",}`, `{"id"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		want, werr := unmarshalBothWays(b)
		var got Envelope
		gerr := got.UnmarshalJSON(b)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("%q: error %v; want %v", b, gerr, werr)
		}
		if werr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n got  %#v\n want %#v", b, got, want)
		}
		if onlyKnownAttrs(b) && json.Valid(b) {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil || m == nil {
				t.Fatalf("%q: shortcut taken for a value that is not an object", b)
			}
			for k := range m {
				if !knownAttrs[k] {
					t.Fatalf("%q: shortcut taken with attribute %q", b, k)
				}
			}
		}
	})
}
