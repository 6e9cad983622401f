// Package agentconfigtest checks, for the fuzz targets of every agent's
// configuration loader, the properties each loader built on [agentconfig]
// must have whatever document it is given; [Fuzz] is such a target.
package agentconfigtest

import (
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/agentconfig"
)

// CheckParse runs parse (an agent's Parse) on the document b and fails t
// unless:
//   - parse is deterministic: a second run returns the same configuration,
//     or an error with the same text (problems in a stable order);
//   - a refusal is an [*agentconfig.Error] listing at least one problem,
//     each with a reason and on one line (a key or value with a line break
//     cannot forge another problem);
//   - an accepted configuration written back as YAML ([Encode]) is accepted
//     and parses to the same configuration: defaults are idempotent and the
//     checks pass on what they passed once.
func CheckParse[T any](t testing.TB, parse func([]byte) (*T, error), b []byte) {
	t.Helper()
	c1, err1 := parse(b)
	c2, err2 := parse(b)
	if (err1 == nil) != (err2 == nil) || err1 != nil && err1.Error() != err2.Error() || !reflect.DeepEqual(c1, c2) {
		t.Fatalf("parse is not deterministic on %q:\n%v\n%v", b, err1, err2)
	}
	if err1 != nil {
		if c1 != nil {
			t.Fatalf("parse of %q returned a configuration with its error %v", b, err1)
		}
		e, ok := errors.AsType[*agentconfig.Error](err1)
		if !ok || len(e.Problems) == 0 {
			t.Fatalf("parse of %q refused with %T %v; want an *agentconfig.Error listing problems", b, err1, err1)
		}
		for _, p := range e.Problems {
			if strings.TrimSpace(p.Reason) == "" || strings.ContainsAny(p.Key+p.Reason, "\r\n") {
				t.Fatalf("parse of %q: problem %q has no reason or is not on one line", b, p)
			}
		}
		return
	}
	out, err := Encode(c1)
	if err != nil {
		t.Fatalf("configuration %+v does not encode: %v", c1, err)
	}
	c3, err := parse(out)
	if err != nil {
		t.Fatalf("parse accepted %q, but refuses it written back:\n%s\n%v", b, out, err)
	}
	if !reflect.DeepEqual(c1, c3) {
		t.Fatalf("parse of %q written back as\n%s\ngives %+v; want %+v", b, out, c3, c1)
	}
}

// Encode writes a configuration as the YAML document its loader reads:
// fields under their yaml names, [agentconfig.Duration] as a duration
// string, nil pointers, maps and slices left out.
func Encode(v any) ([]byte, error) {
	return yaml.Marshal(plain(reflect.ValueOf(v)))
}

var durationType = reflect.TypeFor[agentconfig.Duration]()

func plain(v reflect.Value) any {
	if v.Type() == durationType {
		return time.Duration(v.Int()).String()
	}
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return nil
		}
		return plain(v.Elem())
	case reflect.Struct:
		m := map[string]any{}
		t := v.Type()
		for i := range t.NumField() {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if !f.IsExported() || name == "-" {
				continue
			}
			if name == "" {
				name = strings.ToLower(f.Name)
			}
			fv := v.Field(i)
			switch fv.Kind() {
			case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Interface:
				if fv.IsNil() {
					continue
				}
			}
			m[name] = plain(fv)
		}
		return m
	case reflect.Map:
		m := make(map[string]any, v.Len())
		for it := v.MapRange(); it.Next(); {
			m[it.Key().String()] = plain(it.Value())
		}
		return m
	case reflect.Slice, reflect.Array:
		s := make([]any, v.Len())
		for i := range s {
			s[i] = plain(v.Index(i))
		}
		return s
	}
	return v.Interface()
}

// Fuzz is the fuzz target of an agent's configuration loader: f is seeded
// with the ```yaml blocks of the Markdown files docs (the documented
// examples, see [YAMLBlocks]) and with seeds, and every input goes through
// [CheckParse] with parse.
func Fuzz[T any](f *testing.F, parse func([]byte) (*T, error), docs []string, seeds ...string) {
	f.Helper()
	for _, doc := range docs {
		for _, b := range YAMLBlocks(f, doc) {
			f.Add(b)
		}
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		CheckParse(t, parse, b)
	})
}

// YAMLBlocks returns the fenced ```yaml blocks of the Markdown file at
// path: the configuration examples of an agent's documentation, which make
// seeds of its fuzz target.
func YAMLBlocks(t testing.TB, path string) [][]byte {
	t.Helper()
	md, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	var block *strings.Builder
	for line := range strings.Lines(string(md)) {
		switch {
		case block == nil && strings.TrimSpace(line) == "```yaml":
			block = &strings.Builder{}
		case block != nil && strings.TrimSpace(line) == "```":
			out = append(out, []byte(block.String()))
			block = nil
		case block != nil:
			block.WriteString(line)
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s holds no yaml block", path)
	}
	return out
}
