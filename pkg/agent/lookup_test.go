package agent_test

import (
	"errors"
	"testing"

	"proxyfleet/pkg/agent"
)

func TestLookup(t *testing.T) {
	images := map[string]string{"debian-12": "img-12", "debian-13": "img-13"}
	for _, c := range []struct {
		key, def, want, err string
		m                   map[string]string
	}{
		{key: "debian-13", def: "debian-12", want: "img-13", m: images},
		{def: "debian-12", want: "img-12", m: images},
		{key: "alpine", def: "debian-12", m: images, err: `image "alpine" is not configured in entry e1 (configured: debian-12, debian-13)`},
		{m: images, err: "the pool names no image and entry e1 has no default one (configured: debian-12, debian-13)"},
		{key: "x", err: `image "x" is not configured in entry e1 (configured: none)`},
	} {
		got, err := agent.Lookup("e1", "image", c.m, c.key, c.def)
		if c.err != "" {
			if err == nil || err.Error() != c.err || !errors.Is(err, agent.ErrPermanent) {
				t.Errorf("Lookup(%q, %q) = %q, %v; want the permanent error %q", c.key, c.def, got, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("Lookup(%q, %q) = %q, %v; want %q", c.key, c.def, got, err, c.want)
		}
	}
}
