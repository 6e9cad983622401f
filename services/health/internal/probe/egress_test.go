package probe

import (
	"fmt"
	"testing"
)

func TestEgressIndexCountsGroups(t *testing.T) {
	x := newEgressIndex()
	check := func(step string, want map[string]int) {
		t.Helper()
		for id, n := range want {
			if got := x.others(id); got != n {
				t.Errorf("%s: others(%s) = %d, want %d", step, id, got, n)
			}
		}
	}
	x.set("a", "192.0.2.1")
	check("a alone", map[string]int{"a": 0})
	x.set("b", "192.0.2.1")
	x.set("c", "192.0.2.1")
	x.set("d", "198.51.100.7")
	check("a, b, c join one group", map[string]int{"a": 2, "b": 2, "c": 2, "d": 0, "unknown": 0})
	x.set("b", "192.0.2.1") // the same answer again changes nothing
	check("b probed again", map[string]int{"a": 2, "b": 2, "c": 2})
	x.set("c", "198.51.100.7")
	check("c changes IP", map[string]int{"a": 1, "b": 1, "c": 1, "d": 1})
	if ip := x.ip("c"); ip != "198.51.100.7" {
		t.Fatalf("ip(c) = %q, want 198.51.100.7", ip)
	}
	x.set("a", "")
	check("a leaves", map[string]int{"a": 0, "b": 0, "c": 1, "d": 1})
	if ip := x.ip("a"); ip != "" {
		t.Fatalf("ip(a) after leaving = %q, want none", ip)
	}
	x.set("a", "") // leaving twice is harmless
	x.set("b", "")
	x.set("c", "")
	x.set("d", "")
	if len(x.of) != 0 || len(x.count) != 0 {
		t.Fatalf("index not empty after every proxy left: %v %v", x.of, x.count)
	}
}

// A large group costs no more than a small one: 1000 proxies behind one
// address each count 999 others.
func TestEgressIndexLargeGroup(t *testing.T) {
	x := newEgressIndex()
	for i := range 1000 {
		x.set(fmt.Sprintf("p%d", i), "127.0.0.1")
	}
	if got := x.others("p500"); got != 999 {
		t.Fatalf("others = %d, want 999", got)
	}
	for i := range 500 {
		x.set(fmt.Sprintf("p%d", i), "127.0.0.2")
	}
	if a, b := x.others("p0"), x.others("p999"); a != 499 || b != 499 {
		t.Fatalf("after half moved: %d and %d others, want 499 each", a, b)
	}
}
