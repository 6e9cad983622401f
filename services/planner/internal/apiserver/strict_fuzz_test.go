package apiserver

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// apiBodies are the request types the API handlers decode with
// decodeStrict, with whether the handler accepts an empty body.
var apiBodies = []struct {
	name       string
	new        func() any
	allowEmpty bool
}{
	{"pool.apply", func() any { return &events.PoolSpec{} }, false},
	{"pool.get", func() any { return &api.NameRequest{} }, false},
	{"pool.list", func() any { return &api.PoolListRequest{} }, true},
	{"proxy.get", func() any { return &api.ProxyRequest{} }, false},
	{"proxy.list", func() any { return &api.ProxyListRequest{} }, true},
	{"proxy.delete", func() any { return &api.ProxyDeleteRequest{} }, false},
	{"proxy.recycle", func() any { return &api.ProxyRecycleRequest{} }, false},
	{"proxy.report-ban", func() any { return &api.ProxyBanRequest{} }, false},
	{"instance.delete", func() any { return &api.InstanceDeleteRequest{} }, false},
	{"probe", func() any { return &strictProbe{} }, false},
}

// FuzzDecodeStrict: the API's request decoder. A refusal is a 400 that
// names the offending value by a path, on one line; what it accepts has
// no duplicate key at any depth, only keys that are exactly a field's JSON
// name, decodes as encoding/json decodes it, and its re-encoding is
// accepted and decodes to the same value.
func FuzzDecodeStrict(f *testing.F) {
	for i, s := range []string{
		`{"name":"demo","provider":"local","targets":["t1"],"size":2,"auth":{"username":"u","password":"p"},"maxAge":"72h","unhealthyAfter":"30s","port":3128,"userData":"#cloud-config\n"}`,
		`{"name":"demo"}`,
		`{"limit":10,"after":"demo"}`,
		`{"id":"px-1"}`,
		`{"pool":"demo","limit":1}`,
		`{"id":"px-1","skipCleanup":true}`,
		`{"id":"px-1","now":true}`,
		`{"id":"px-1","reason":"banned by example.org"}`,
		`{"entry":"kvm","target":"host-1","name":"px-aaaa"}`,
		`{"kind":"k","count":"12","raw":[1,{"a":2}],"blob":"AQI=","small":-128,"labels":{"a":"b"},"items":[{"key":"x"}],"extra":{"y":[{"z":null}]}}`,
	} {
		f.Add(uint8(i), []byte(s))
	}
	for _, s := range []string{
		`{"name":"a","name":"b"}`,
		`{"auth":{"username":"u","username":"v"},"size":1}`,
		`{"name":"a","n\u0061me":"b"}`,
		`{"NAME":"a","size":1}`,
		`{"extra":{"k":1,"k":2}}`,
		`{"raw":{"k":1,"k":2}}`,
		`{"labels":{"a":"b","a":"c"}}`,
		`{"size":1e2}`, `{"size":99999999999999999999}`, `{"maxAge":"-1h","size":0}`, `{"maxAge":{"a":1,"a":2}}`,
		"{\"\xff\":1}", "{\"a\nb\":1}", `{"name":"a"} x`, `null`, ``, ` `, `[{}]`,
	} {
		f.Add(uint8(0), []byte(s))
		f.Add(uint8(9), []byte(s))
	}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		ep := apiBodies[int(which)%len(apiBodies)]
		out := ep.new()
		present, aerr := decodeStrictPresent(body, out, ep.allowEmpty)
		if aerr != nil {
			if aerr.Status != "400" || aerr.Code != api.CodeBadRequest {
				t.Fatalf("%s %q: refused with %s %s; want 400 %s", ep.name, body, aerr.Status, aerr.Code, api.CodeBadRequest)
			}
			if len(aerr.Fields) != 1 || aerr.Fields[0].Field == "" || aerr.Message != aerr.Fields[0].Field+": "+aerr.Fields[0].Reason {
				t.Fatalf("%s %q: refusal %q does not name a field path: %+v", ep.name, body, aerr.Message, aerr.Fields)
			}
			if strings.ContainsAny(aerr.Message, "\r\n") {
				t.Fatalf("%s %q: refusal %q is more than one line", ep.name, body, aerr.Message)
			}
			return
		}
		if len(bytes.TrimSpace(body)) == 0 {
			if !ep.allowEmpty {
				t.Fatalf("%s: accepted an empty body", ep.name)
			}
			return
		}
		if dup := duplicateKey(body); dup != "" {
			t.Fatalf("%s %q: accepted the duplicate key %q", ep.name, body, dup)
		}
		if k := inexactKey(body, reflect.TypeOf(out)); k != "" {
			t.Fatalf("%s %q: accepted the key %q, which is not a field's exact JSON name", ep.name, body, k)
		}
		viaJSON := ep.new()
		if err := json.Unmarshal(body, viaJSON); err != nil || !reflect.DeepEqual(out, viaJSON) {
			t.Fatalf("%s %q: decoded %+v; encoding/json decodes %+v, %v", ep.name, body, out, viaJSON, err)
		}
		var top map[string]json.RawMessage
		if err := json.Unmarshal(body, &top); err != nil {
			t.Fatal(err)
		}
		for k, v := range top {
			if present[joinPath("", k)] == bytes.Equal(bytes.TrimSpace(v), []byte("null")) {
				t.Fatalf("%s %q: present[%q] = %v for the value %s", ep.name, body, k, present[k], v)
			}
		}
		enc, err := json.Marshal(out)
		if err != nil {
			t.Fatalf("%s: %+v does not encode: %v", ep.name, out, err)
		}
		again := ep.new()
		if aerr := decodeStrict(enc, again, ep.allowEmpty); aerr != nil {
			t.Fatalf("%s: the re-encoding %s of %q is refused: %v", ep.name, enc, body, aerr)
		}
		if !reflect.DeepEqual(out, again) {
			t.Fatalf("%s: %s decodes to %+v; want %+v", ep.name, enc, again, out)
		}
	})
}

// duplicateKey returns a key that appears twice in one object of the JSON
// document b (keys compared after unescaping), or "".
func duplicateKey(b []byte) string {
	dec := json.NewDecoder(bytes.NewReader(b))
	var walk func() string
	walk = func() string {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		d, ok := tok.(json.Delim)
		if !ok {
			return ""
		}
		seen := map[string]bool{}
		for dec.More() {
			if d == '{' {
				tok, err := dec.Token()
				if err != nil {
					return ""
				}
				k, _ := tok.(string)
				if seen[k] {
					return k
				}
				seen[k] = true
			}
			if dup := walk(); dup != "" {
				return dup
			}
		}
		_, _ = dec.Token()
		return ""
	}
	return walk()
}

// inexactKey returns a key of the JSON document b, decoded into a value
// of type t, that is not exactly the JSON name of a field of the struct it
// lands in, or "". Values that decode themselves are not looked into.
func inexactKey(b []byte, t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Interface || reflect.PointerTo(t).Implements(reflect.TypeFor[json.Unmarshaler]()) {
		return ""
	}
	switch t.Kind() {
	case reflect.Struct:
		var m map[string]json.RawMessage
		if json.Unmarshal(b, &m) != nil {
			return ""
		}
		names := map[string]reflect.Type{}
		fieldNames(t, names)
		for k, v := range m {
			ft, ok := names[k]
			if !ok {
				return k
			}
			if bad := inexactKey(v, ft); bad != "" {
				return k + "." + bad
			}
		}
	case reflect.Slice:
		var s []json.RawMessage
		if json.Unmarshal(b, &s) != nil {
			return ""
		}
		for _, v := range s {
			if bad := inexactKey(v, t.Elem()); bad != "" {
				return bad
			}
		}
	case reflect.Map:
		var m map[string]json.RawMessage
		if json.Unmarshal(b, &m) != nil {
			return ""
		}
		for _, v := range m {
			if bad := inexactKey(v, t.Elem()); bad != "" {
				return bad
			}
		}
	}
	return ""
}

// fieldNames lists the JSON names of t's fields, read from the tags alone
// (embedded structs promoted).
func fieldNames(t reflect.Type, into map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-":
		case f.Anonymous && name == "":
			fieldNames(f.Type, into)
		case !f.IsExported():
		case name == "":
			into[f.Name] = f.Type
		default:
			into[name] = f.Type
		}
	}
}
