package events_test

import (
	"errors"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// TestPoolSpecUnhealthyAfter: unhealthyAfter defaults to 2m, may not be
// negative or shorter than 10s, and its problems name the field.
func TestPoolSpecUnhealthyAfter(t *testing.T) {
	cases := []struct {
		in   time.Duration
		want string // the exact validation message, "" when valid
		norm time.Duration
	}{
		{0, "", events.DefaultUnhealthyAfter},
		{events.MinUnhealthyAfter, "", events.MinUnhealthyAfter},
		{10 * time.Minute, "", 10 * time.Minute},
		{events.MinUnhealthyAfter - time.Millisecond, `unhealthyAfter: must be at least 10s (got "9.999s")`, 0},
		{-time.Minute, `unhealthyAfter: must not be negative (got "-1m0s")`, 0},
	}
	for _, c := range cases {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, UnhealthyAfter: events.Duration(c.in)}
		spec.Normalize()
		err := spec.Validate()
		if c.want == "" {
			if err != nil || time.Duration(spec.UnhealthyAfter) != c.norm || spec.UnhealthyAfterOrDefault() != c.norm {
				t.Errorf("%s: err %v, normalized %s, want valid %s", c.in, err, time.Duration(spec.UnhealthyAfter), c.norm)
			}
			continue
		}
		var ve *events.ValidationError
		if !errors.As(err, &ve) || len(ve.Fields) != 1 || ve.Fields[0].Field != "unhealthyAfter" || ve.Fields[0].Error() != c.want {
			t.Errorf("%s: got %v, want exactly %q", c.in, err, c.want)
		}
	}
}

// TestPoolSpecSize: a pool holds 0 to MaxPoolSize (100,000) proxies; a size
// outside names the field and the bound.
func TestPoolSpecSize(t *testing.T) {
	if events.MaxPoolSize != 100_000 {
		t.Errorf("MaxPoolSize: got %d, want 100000", events.MaxPoolSize)
	}
	cases := []struct {
		size int
		want string // the exact validation message, "" when valid
	}{
		{0, ""},
		{1, ""},
		{100_000, ""},
		{100_001, `size: must be at most 100000 (got "100001")`},
		{-1, `size: must be zero or more (got "-1")`},
	}
	for _, c := range cases {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: c.size}
		spec.Normalize()
		err := spec.Validate()
		if c.want == "" {
			if err != nil {
				t.Errorf("size %d: got %v, want valid", c.size, err)
			}
			continue
		}
		var ve *events.ValidationError
		if !errors.As(err, &ve) || len(ve.Fields) != 1 || ve.Fields[0].Error() != c.want {
			t.Errorf("size %d: got %v, want exactly %q", c.size, err, c.want)
		}
	}
}
