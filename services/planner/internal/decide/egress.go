package decide

import (
	"sort"
	"strings"
)

// SharedEgressPrefix starts the replacement reason of a member replaced
// because another member of its pool already egresses from its address
// (a pool with distinctEgress).
const SharedEgressPrefix = "shared-egress"

// sharedEgress returns, for a pool with distinctEgress, the member of
// counted to replace because an older member of the pool egresses from
// the same address (the one of its last ready event, as health measured
// it), and why; ok is false when there is none, or when a replacement for
// a shared egress is under way already: one at a time, so a backend that
// can only give one address does not churn the whole pool at once. Of the
// members sharing an address the oldest is kept and the newest replaced
// first.
func sharedEgress(pool *Pool, counted, condemned []Proxy, replacements map[string]Proxy) (Proxy, string, bool) {
	if !pool.Spec.DistinctEgress {
		return Proxy{}, "", false
	}
	for _, x := range condemned {
		if _, replaced := Replacement(replacements, x); replaced && strings.HasPrefix(x.ReplaceReason, SharedEgressPrefix) {
			return Proxy{}, "", false
		}
	}
	byIP := map[string][]Proxy{}
	for _, x := range counted {
		if x.EgressIP != "" {
			byIP[x.EgressIP] = append(byIP[x.EgressIP], x)
		}
	}
	var newest Proxy
	var keeper Proxy
	found := false
	for _, group := range byIP {
		if len(group) < 2 {
			continue
		}
		sort.Slice(group, func(i, j int) bool { return older(group[i], group[j]) })
		if y := group[len(group)-1]; !found || older(newest, y) {
			newest, keeper, found = y, group[0], true
		}
	}
	if !found {
		return Proxy{}, "", false
	}
	return newest, SharedEgressPrefix + ": egress " + newest.EgressIP + " is " + keeper.ID + "'s too", true
}

// older orders members by creation, then by id.
func older(a, b Proxy) bool {
	if !a.CreatedAt.Equal(b.CreatedAt) {
		return a.CreatedAt.Before(b.CreatedAt)
	}
	return a.ID < b.ID
}
