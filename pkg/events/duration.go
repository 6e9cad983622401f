package events

import (
	"encoding/json"
	"fmt"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

// Duration is a time.Duration written as a Go duration string ("72h").
type Duration time.Duration

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	if d == 0 {
		return []byte(`""`), nil
	}
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON accepts a duration string such as "90m" or "72h".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("must be a duration string such as \"72h\"")
	}
	if s == "" {
		*d = 0
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("must be a duration string such as \"72h\": %q", s)
	}
	*d = Duration(v)
	return nil
}

// UnmarshalYAML accepts a duration string such as "30s" or "20m", so
// configuration files and the wire contract write durations one way. A bad
// value is reported as a [yaml.TypeError] naming its line, which lets the
// decoder go on and report every other problem of the document too.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	const want = `must be a duration such as "30s" or "10m"`
	if n.Kind != yaml.ScalarNode {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %s", n.Line, want)}}
	}
	if n.Value == "" {
		*d = 0
		return nil
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: %s, got %q", n.Line, want, n.Value)}}
	}
	*d = Duration(v)
	return nil
}
