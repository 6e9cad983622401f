package apiserver

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"proxyfleet/pkg/page"
)

// TestReplyOverTheBudgetIsRefused: any reply over the budget is refused,
// not sent to be dropped.
func TestReplyOverTheBudgetIsRefused(t *testing.T) {
	budget := page.Budget(1 << 20)
	if _, aerr := encodeReply(json.RawMessage(`"`+strings.Repeat("x", budget-2)+`"`), budget); aerr != nil {
		t.Errorf("a reply of exactly the budget: %v", aerr)
	}
	if _, aerr := encodeReply(strings.Repeat("x", budget), budget); aerr == nil || aerr.Status != "500" ||
		!strings.Contains(aerr.Message, "does not fit under the server's max payload") {
		t.Errorf("a reply over the budget: got %v, want a 500 saying it does not fit", aerr)
	}
}

// TestFirstAfterMatchesASort: the heap selection returns what sorting
// everything and slicing would, for every cursor and size.
func TestFirstAfterMatchesASort(t *testing.T) {
	keys := make([]string, 0, 500)
	for i := range 500 {
		keys = append(keys, fmt.Sprintf("k-%x", (i*7919)%1009)) // distinct, not in order
	}
	sorted := slices.Sorted(slices.Values(keys))
	for _, after := range []string{"", sorted[0], sorted[137], sorted[498], sorted[499], "k-0", "zzz"} {
		for _, n := range []int{1, 2, 10, 499, 500, 501, 1001} {
			got := page.FirstAfter(slices.Values(keys), func(s string) string { return s }, after, n)
			i, _ := slices.BinarySearch(sorted, after)
			for i < len(sorted) && sorted[i] <= after {
				i++
			}
			want := sorted[i:min(len(sorted), i+n)]
			if !slices.Equal(got, want) {
				t.Errorf("after %q, n %d: got %d keys %v…, want %d", after, n, len(got), got[:min(3, len(got))], len(want))
			}
		}
	}
}

// TestPageJSONFitsEveryBudget: whatever the budget, the page it writes
// decodes as a list reply, stays within the budget, and its next resumes
// exactly after its last item; an item too big for any page is refused,
// naming it.
func TestPageJSONFitsEveryBudget(t *testing.T) {
	type item struct {
		ID  string `json:"id"`
		Pad string `json:"pad"`
	}
	var items []item
	for i := range 40 {
		items = append(items, item{ID: fmt.Sprintf("x-%03d", i), Pad: strings.Repeat("p", i*7%50)})
	}
	key := func(it item) string { return it.ID }
	for budget := 200; budget <= 4000; budget += 37 {
		for _, limit := range []int{1, 5, 39, 40, 41} {
			raw, aerr := pageJSON("items", items, key, limit, budget, "item")
			if aerr != nil {
				t.Fatalf("budget %d limit %d: %v", budget, limit, aerr)
			}
			if len(raw) > budget {
				t.Errorf("budget %d limit %d: %d bytes", budget, limit, len(raw))
			}
			var got struct {
				Items []item `json:"items"`
				Next  string `json:"next"`
			}
			if err := json.Unmarshal(raw, &got); err != nil {
				t.Fatalf("budget %d limit %d: %v: %s", budget, limit, err, raw)
			}
			n := len(got.Items)
			if n == 0 || n > limit || !slices.Equal(got.Items, items[:n]) {
				t.Fatalf("budget %d limit %d: got %d items, want a prefix of at most %d", budget, limit, n, limit)
			}
			wantNext := ""
			if n < len(items) {
				wantNext = items[n-1].ID
			}
			if got.Next != wantNext {
				t.Errorf("budget %d limit %d: next %q, want %q", budget, limit, got.Next, wantNext)
			}
			if n < limit && n < len(items) {
				// Cut for size: the next item would not have fit.
				b, _ := json.Marshal(items[n])
				if len(raw)+1+len(b) <= budget-63 {
					t.Errorf("budget %d limit %d: cut at %d items though item %d (%d bytes) fits", budget, limit, n, n, len(b))
				}
			}
		}
	}
	big := []item{{ID: "x-big", Pad: strings.Repeat("p", 500)}}
	if _, aerr := pageJSON("items", big, key, 10, 300, "item"); aerr == nil || !strings.Contains(aerr.Message, `item x-big alone does not fit`) || !strings.Contains(aerr.Message, `"after":"x-big"`) {
		t.Errorf("an item over the budget: got %v, want an error naming it and how to list on", aerr)
	}
}
