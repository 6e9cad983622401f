package planner

import (
	"encoding/json"
	"fmt"
	"iter"
	"slices"
	"strconv"
	"strings"

	"proxyfleet/pkg/events"
)

// Paging of the list replies (proxy.list, pool.list). Items are ordered by
// key (proxy id, pool name); a page holds the first items whose key sorts
// after the request's After, and its Next is the key of its last item when
// more follow. The cursor is a key, not a position: an item added or removed
// between two requests shifts no other, so a walk returns every item that
// lives throughout it exactly once, in order.
//
// Every reply must fit in one NATS message: a page holds at most Limit
// items and is cut short, with Next set, where the next item would take it
// over the connection's max payload (see [Planner.replyBudget]).
const (
	// DefaultPageLimit is the size of a page when the request sets no limit.
	DefaultPageLimit = 500
	// MaxPageLimit is the largest limit a request may set.
	MaxPageLimit = 1000
)

// replyHeadroom is kept free below the connection's max payload: a reply's
// bytes on the wire are its body plus its headers.
const replyHeadroom = 1024

// PageRequest is the paging part of a list request.
type PageRequest struct {
	// Limit is the most items the page holds: 1 to [MaxPageLimit],
	// [DefaultPageLimit] when left out. A page may hold fewer when more
	// would not fit in one message; only an empty Next ends a walk.
	Limit int `json:"limit,omitempty"`
	// After is the Next of the previous page: the page starts with the
	// first item whose key sorts after it. Empty starts at the beginning.
	After string `json:"after,omitempty"`
}

// check validates the paging fields of a request decoded with present (the
// keys it carried) and returns the limit to use. what names the key After
// holds ("proxy id", "pool name").
func (r PageRequest) check(present map[string]bool, what string) (int, []events.FieldError) {
	var fields []events.FieldError
	limit := DefaultPageLimit
	if present["limit"] {
		limit = r.Limit
		if limit < 1 || limit > MaxPageLimit {
			fields = append(fields, events.FieldError{Field: "limit",
				Reason: fmt.Sprintf("must be between 1 and %d", MaxPageLimit), Value: strconv.Itoa(r.Limit)})
		}
	}
	if r.After != "" && !events.IsIdentifier(r.After) {
		fields = append(fields, events.FieldError{Field: "after",
			Reason: `must be the "next" of a previous page, a ` + what + ` (` + events.IdentifierRule + `)`, Value: clip(r.After)})
	}
	return limit, fields
}

// replyBudget is the most bytes a reply body may take: the max payload the
// server announced to this connection, less room for headers.
func (p *Planner) replyBudget() int {
	return replyBudgetOf(p.conn.NC.MaxPayload())
}

func replyBudgetOf(maxPayload int64) int {
	if maxPayload < 4*replyHeadroom {
		return int(maxPayload / 2)
	}
	return int(maxPayload - replyHeadroom)
}

// firstAfter returns, in key order, the n items of all with the smallest
// keys greater than after (every such item when there are fewer). It holds
// n items at a time in a max-heap, so a page of a big fleet costs one pass
// over it, not a sort of it.
func firstAfter[T any](all iter.Seq[T], key func(T) string, after string, n int) []T {
	if n <= 0 {
		return nil
	}
	h := make([]T, 0, n)
	less := func(i, j int) bool { return key(h[i]) < key(h[j]) }
	down := func(i int) {
		for {
			big, l, r := i, 2*i+1, 2*i+2
			if l < len(h) && less(big, l) {
				big = l
			}
			if r < len(h) && less(big, r) {
				big = r
			}
			if big == i {
				return
			}
			h[i], h[big] = h[big], h[i]
			i = big
		}
	}
	for x := range all {
		k := key(x)
		if k <= after {
			continue
		}
		if len(h) < n {
			h = append(h, x)
			for i := len(h) - 1; i > 0 && less((i-1)/2, i); i = (i - 1) / 2 {
				h[i], h[(i-1)/2] = h[(i-1)/2], h[i]
			}
			continue
		}
		if k < key(h[0]) {
			h[0] = x
			down(0)
		}
	}
	slices.SortFunc(h, func(a, b T) int { return strings.Compare(key(a), key(b)) })
	return h
}

// pageJSON writes the reply {"<field>":[items…],"next":"<key>"} in at most
// budget bytes. items are the candidates in key order: up to limit of them
// are taken, fewer when the next would not fit; Next is the key of the last
// item taken when any candidate is left, else "". An item too big for a
// reply of its own is refused with a message naming it.
func pageJSON[T any](field string, items []T, key func(T) string, limit, budget int, what string) (json.RawMessage, *APIError) {
	buf := make([]byte, 0, 4096)
	buf = append(buf, `{"`...)
	buf = append(buf, field...)
	buf = append(buf, `":[`...)
	// The widest ending: a key is an identifier, so it needs no escaping.
	const tail = len(`],"next":""}`) + 63
	n := 0
	for n < len(items) && n < limit {
		b, err := json.Marshal(items[n])
		if err != nil {
			return nil, internal("could not encode the page; retry")
		}
		sep := 0
		if n > 0 {
			sep = 1
		}
		if len(buf)+sep+len(b)+tail > budget {
			if n == 0 {
				k := key(items[0])
				return nil, internal(fmt.Sprintf("%s %s alone does not fit in a reply under the server's max payload (%d bytes); list on after it with \"after\":%q",
					what, k, budget, k))
			}
			break
		}
		if sep == 1 {
			buf = append(buf, ',')
		}
		buf = append(buf, b...)
		n++
	}
	next := ""
	if n < len(items) {
		next = key(items[n-1])
	}
	buf = append(buf, `],"next":`...)
	buf = strconv.AppendQuote(buf, next)
	buf = append(buf, '}')
	return buf, nil
}
