package probe

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
)

func proxyIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("pool-%d-%05d", i%7, i)
	}
	return ids
}

// The assignment is a function of the proxy and the member set: the same on
// every replica, whatever order they list the members in.
func TestOwnerIsStableAndExclusive(t *testing.T) {
	members := []string{"health-a", "health-b", "health-c"}
	for _, id := range proxyIDs(2000) {
		o := owner(id, members)
		if !slices.Contains(members, o) {
			t.Fatalf("%s: owner %q is no member", id, o)
		}
		for range 3 {
			if again := owner(id, members); again != o {
				t.Fatalf("%s: owner %q, then %q", id, o, again)
			}
		}
		// Exactly one member has the highest score.
		top := 0
		for _, m := range members {
			if score(m, id) == score(o, id) {
				top++
			}
		}
		if top != 1 {
			t.Fatalf("%s: %d members share the top score", id, top)
		}
	}
	if o := owner("x", nil); o != "" {
		t.Fatalf("no members: owner %q, want none", o)
	}
	if o := owner("x", []string{"solo"}); o != "solo" {
		t.Fatalf("one member: owner %q, want solo", o)
	}
}

func TestOwnerIsBalanced(t *testing.T) {
	ids := proxyIDs(20000)
	for _, n := range []int{2, 3, 5} {
		var members []string
		for i := range n {
			members = append(members, fmt.Sprintf("host%d-%d", i, 4000+i))
		}
		count := map[string]int{}
		for _, id := range ids {
			count[owner(id, members)]++
		}
		want := float64(len(ids)) / float64(n)
		for _, m := range members {
			if dev := math.Abs(float64(count[m])-want) / want; dev > 0.05 {
				t.Errorf("%d members: %s owns %d proxies, %.1f%% off the even share %.0f", n, m, count[m], 100*dev, want)
			}
		}
	}
}

// When a member leaves, only its proxies move, and they spread over the
// others; when one joins, only proxies moving to it move.
func TestOwnerMovesOnlyWhatItMust(t *testing.T) {
	ids := proxyIDs(12000)
	all := []string{"a", "b", "c", "d"}
	without := []string{"a", "b", "d"}
	moved := map[string]int{}
	for _, id := range ids {
		before, after := owner(id, all), owner(id, without)
		if before != "c" && after != before {
			t.Fatalf("%s moved from %s to %s though %s stayed", id, before, after, before)
		}
		if before == "c" {
			moved[after]++
		}
	}
	left := moved["a"] + moved["b"] + moved["d"]
	if left == 0 {
		t.Fatal("c owned nothing")
	}
	for _, m := range without {
		if share := float64(moved[m]) / float64(left); share < 0.25 || share > 0.42 {
			t.Errorf("%s took %.0f%% of c's proxies, want about a third", m, 100*share)
		}
	}
	// Joining is leaving backwards.
	for _, id := range ids {
		if before, after := owner(id, without), owner(id, all); after != before && after != "c" {
			t.Fatalf("%s moved from %s to %s when c joined", id, before, after)
		}
	}
}

func TestCheckReplica(t *testing.T) {
	for _, ok := range []string{"health-1", "node1.example.org-4242", "a", "A_b=c"} {
		if err := CheckReplica(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".a", "a.", "a..b", "a b", "a/b", "a*", "a>", strings.Repeat("a", 129)} {
		if err := CheckReplica(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
