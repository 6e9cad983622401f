package decide

import (
	"testing"
)

func TestFallbackCycle(t *testing.T) {
	recorded := map[string][]string{
		"b":    {"a"},
		"c":    {"d"},
		"d":    {"a", "e"},
		"e":    nil,
		"loop": {"loop2"}, "loop2": {"loop"}, // a cycle of others, not through a
	}
	of := func(p string) []string { return recorded[p] }
	cases := []struct {
		name     string
		fallback []string
		index    int
		cycle    string // "" for none
	}{
		{name: "a", fallback: []string{"b"}, index: 0, cycle: "a → b → a"},
		{name: "a", fallback: []string{"e", "c"}, index: 1, cycle: "a → c → d → a"},
		{name: "a", fallback: []string{"e"}},
		{name: "a", fallback: []string{"loop", "e"}},
		{name: "a", fallback: []string{"unknown"}},
		{name: "a", fallback: nil},
		{name: "e", fallback: []string{"c"}, index: 0, cycle: "e → c → d → e"},
		{name: "x", fallback: []string{"b"}},
	}
	for _, tc := range cases {
		i, cycle, ok := FallbackCycle(tc.name, tc.fallback, of)
		switch {
		case tc.cycle == "" && ok:
			t.Errorf("%s → %v: cycle %s at %d, want none", tc.name, tc.fallback, CycleText(cycle), i)
		case tc.cycle != "" && (!ok || i != tc.index || CycleText(cycle) != tc.cycle):
			t.Errorf("%s → %v: %v %d %q, want fallback[%d] %q", tc.name, tc.fallback, ok, i, CycleText(cycle), tc.index, tc.cycle)
		}
	}
}
