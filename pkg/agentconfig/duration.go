package agentconfig

import (
	"fmt"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

// Duration is a time.Duration written as a Go duration string ("30s",
// "10m"), the one way configuration files write durations. An empty value
// is zero, which lets the agent's default apply.
type Duration time.Duration

// UnmarshalYAML reads a duration string. A bad value is reported as a
// [yaml.TypeError] naming its line, which lets [Decode] go on, report every
// other problem of the document too, and name the value's key.
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
