package apiserver

import (
	"encoding/json"
	"reflect"
	"testing"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// strictProbe exercises the decoder's walk over shapes the API's request
// types may grow into: maps, slices of structs, free-form values, embedded
// structs and the ",string" option.
type strictProbe struct {
	strictEmbedded
	Labels map[string]string `json:"labels,omitempty"`
	Items  []strictItem      `json:"items,omitempty"`
	Extra  any               `json:"extra,omitempty"`
	Raw    json.RawMessage   `json:"raw,omitempty"`
	Count  int64             `json:"count,string,omitempty"`
	Small  int8              `json:"small,omitempty"`
	Ratio  float32           `json:"ratio,omitempty"`
	Blob   []byte            `json:"blob,omitempty"`
	Hidden string            `json:"-"`
}

type strictEmbedded struct {
	Kind string `json:"kind,omitempty"`
}

type strictItem struct {
	Key string `json:"key"`
}

func TestDecodeStrictNamesEveryRefusalByPath(t *testing.T) {
	cases := []struct {
		name string
		into func() any
		body string
		want string // the exact message
	}{
		// The body as a whole.
		{"empty", spec, ``, `(body): is empty; send a JSON object`},
		{"null", spec, `null`, `(body): must be a JSON object, not null`},
		{"array", spec, `[1,2]`, `(body): must be a JSON object`},
		{"string", spec, `"x"`, `(body): must be a JSON object`},
		{"truncated", spec, `{"name":"a","size":`, `(body): malformed JSON at byte 19: unexpected end of JSON input`},
		{"bad token", spec, `{"name" 1}`, `(body): malformed JSON at byte 9: invalid character '1' after object key`},
		{"trailing object", spec, `{"size":1} {"size":2}`, `(body): malformed JSON at byte 12: invalid character '{' after top-level value`},
		{"trailing garbage", spec, `{"size":1}x`, `(body): malformed JSON at byte 11: invalid character 'x' after top-level value`},

		// Keys match exactly.
		{"upper-case key", spec, `{"NAME":"a","size":1}`, `NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"mixed-case key", spec, `{"name":"a","Size":1}`, `Size: unknown field; keys are case-sensitive: did you mean "size"?`},
		{"unknown key", spec, `{"colour":"red"}`, `colour: unknown field`},
		{"odd key quoted", spec, `{"a b\n":1}`, `"a b\n": unknown field`},
		{"nested unknown key", spec, `{"auth":{"user":"u"}}`, `auth.user: unknown field`},
		{"nested upper-case key", spec, `{"auth":{"USERNAME":"u"}}`, `auth.USERNAME: unknown field; keys are case-sensitive: did you mean "username"?`},

		// Duplicate keys at any depth.
		{"duplicate key", spec, `{"name":"a","size":1,"name":"b"}`, `name: duplicate key`},
		{"duplicate null", spec, `{"size":null,"size":1}`, `size: duplicate key`},
		{"nested duplicate", spec, `{"auth":{"username":"u","password":"p","username":"v"}}`, `auth.username: duplicate key`},
		{"duplicate inside a self-decoding value", spec, `{"maxAge":{"a":1,"a":2}}`, `maxAge.a: duplicate key`},
		{"duplicate in a slice of structs", probe, `{"items":[{"key":"a"},{"key":"b","key":"c"}]}`, `items[1].key: duplicate key`},
		{"duplicate in a map", probe, `{"labels":{"x":"1","x":"2"}}`, `labels.x: duplicate key`},
		{"duplicate in a free-form value", probe, `{"extra":[{"deep":{"k":1,"k":2}}]}`, `extra[0].deep.k: duplicate key`},
		{"duplicate in raw JSON", probe, `{"raw":{"k":1,"k":2}}`, `raw.k: duplicate key`},

		// Types, named by path.
		{"string for integer", spec, `{"size":"3"}`, `size: must be an integer, got string`},
		{"fraction for integer", spec, `{"size":1.5}`, `size: must be an integer, got number 1.5`},
		{"exponent for integer", spec, `{"size":1e3}`, `size: must be an integer, got number 1e3`},
		{"huge integer", spec, `{"size":99999999999999999999}`, `size: is out of range, got number 99999999999999999999`},
		{"object for integer", spec, `{"size":{}}`, `size: must be an integer, got object`},
		{"nested wrong type", spec, `{"auth":{"username":7}}`, `auth.username: must be a string, got number`},
		{"string for object", spec, `{"auth":"u:p"}`, `auth: must be an object, got string`},
		{"string for bool", spec, `{"distinctEgress":"yes"}`, `distinctEgress: must be true or false, got string`},
		{"string for array", spec, `{"targets":"t1"}`, `targets: must be an array, got string`},
		{"element wrong type", spec, `{"targets":["t1",2]}`, `targets[1]: must be a string, got number`},
		{"bad duration", spec, `{"maxAge":"soon"}`, `maxAge: must be a duration string such as "72h": "soon"`},
		{"number for duration", spec, `{"unhealthyAfter":30}`, `unhealthyAfter: must be a duration string such as "72h"`},
		{"bool for string", probe, `{"kind":true}`, `kind: must be a string, got bool`},
		{"element of slice of structs", probe, `{"items":[{"key":1}]}`, `items[0].key: must be a string, got number`},
		{"map value", probe, `{"labels":{"x":1}}`, `labels.x: must be a string, got number`},
		{"int8 range", probe, `{"small":300}`, `small: is out of range, got number 300`},
		{"float32 range", probe, `{"ratio":1e39}`, `ratio: is out of range, got number 1e39`},
		{"bytes", probe, `{"blob":[1]}`, `blob: must be a base64 string, got array`},
		{"string option", probe, `{"count":3}`, `count: must be a string, got number`},
		{"hidden field", probe, `{"Hidden":"x"}`, `Hidden: unknown field`},

		// Other request types.
		{"pool.get upper-case", name, `{"Name":"demo"}`, `Name: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"proxy.delete duplicate", proxyDel, `{"id":"x","skipCleanup":true,"skipCleanup":false}`, `skipCleanup: duplicate key`},
		{"instance.delete wrong type", instDel, `{"entry":"local","target":"t1","name":["px"]}`, `name: must be a string, got array`},
		{"empty request with a key", func() any { return &struct{}{} }, `{"pool":"x"}`, `pool: unknown field`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			aerr := decodeStrict([]byte(tc.body), tc.into(), false)
			if aerr == nil {
				t.Fatalf("%s: accepted, want %q", tc.body, tc.want)
			}
			if aerr.Status != "400" || aerr.Code != api.CodeBadRequest {
				t.Errorf("status %s code %s, want 400 %s", aerr.Status, aerr.Code, api.CodeBadRequest)
			}
			if aerr.Message != tc.want {
				t.Errorf("message:\n got %q\nwant %q", aerr.Message, tc.want)
			}
			if len(aerr.Fields) != 1 || aerr.Message != aerr.Fields[0].Field+": "+aerr.Fields[0].Reason {
				t.Errorf("fields %+v do not match the message %q", aerr.Fields, aerr.Message)
			}
		})
	}
}

func spec() any     { return &events.PoolSpec{} }
func probe() any    { return &strictProbe{} }
func name() any     { return &api.NameRequest{} }
func proxyDel() any { return &api.ProxyDeleteRequest{} }
func instDel() any  { return &api.InstanceDeleteRequest{} }

func TestDecodeStrictAcceptsWhatItShould(t *testing.T) {
	cases := []struct {
		name    string
		into    any
		body    string
		want    any
		present []string
	}{
		{"full spec", &events.PoolSpec{},
			`{"name":"demo","provider":"local","targets":["t1"],"size":2,"auth":{"username":"u","password":"p"},"maxAge":"72h","unhealthyAfter":"30s"}`,
			&events.PoolSpec{Name: "demo", Provider: "local", Targets: []string{"t1"}, Size: 2, Auth: &events.ProxyAuth{Username: "u", Password: "p"},
				MaxAge: events.Duration(72 * 3600e9), UnhealthyAfter: events.Duration(30e9)},
			[]string{"name", "provider", "targets", "size", "auth", "auth.username", "auth.password", "maxAge", "unhealthyAfter"}},
		{"nulls are absent", &events.PoolSpec{}, `{"name":"demo","size":null,"auth":{"username":null},"maxAge":null}`,
			&events.PoolSpec{Name: "demo", Auth: &events.ProxyAuth{}}, []string{"name", "auth"}},
		{"zero size is present", &events.PoolSpec{}, `{"size":0}`, &events.PoolSpec{}, []string{"size"}},
		{"same key in sibling objects", &strictProbe{}, `{"items":[{"key":"a"},{"key":"b"}],"extra":{"key":1,"x":{"key":2}}}`,
			&strictProbe{Items: []strictItem{{"a"}, {"b"}}, Extra: map[string]any{"key": 1.0, "x": map[string]any{"key": 2.0}}},
			[]string{"items", "items[0].key", "items[1].key", "extra", "extra.key", "extra.x", "extra.x.key"}},
		{"embedded, string option, raw", &strictProbe{}, `{"kind":"k","count":"12","raw":[1, {"a":2}],"blob":"AQI=","small":-128}`,
			&strictProbe{strictEmbedded: strictEmbedded{Kind: "k"}, Count: 12, Raw: json.RawMessage(`[1, {"a":2}]`), Blob: []byte{1, 2}, Small: -128},
			[]string{"kind", "count", "raw", "blob", "small"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			present, aerr := decodeStrictPresent([]byte(tc.body), tc.into, false)
			if aerr != nil {
				t.Fatalf("%s: refused: %v", tc.body, aerr)
			}
			if !reflect.DeepEqual(tc.into, tc.want) {
				t.Errorf("decoded %+v, want %+v", tc.into, tc.want)
			}
			want := map[string]bool{}
			for _, k := range tc.present {
				want[k] = true
			}
			if !reflect.DeepEqual(present, want) {
				t.Errorf("present: got %v, want %v", present, want)
			}
		})
	}
	if aerr := decodeStrict(nil, &api.ProxyListRequest{}, true); aerr != nil {
		t.Errorf("empty body where allowed: %v", aerr)
	}
}
