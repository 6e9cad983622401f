// Package page is how every list reply of the fleet's APIs is paged and
// kept inside one NATS message: items ordered by key, a page of the first
// items whose key sorts after the request's After, and a Next cursor (the
// key of the page's last item when more follow, "" at the end). The cursor
// is a key, not a position: an item added or removed between two requests
// shifts no other, so a walk returns every item that lives throughout it
// exactly once, in order.
package page

import (
	"encoding/json"
	"fmt"
	"iter"
	"slices"
	"strconv"
	"strings"
)

const (
	// DefaultLimit is the size of a page when the request sets no limit.
	DefaultLimit = 500
	// MaxLimit is the largest limit a request may set.
	MaxLimit = 1000
)

// headroom is kept free below the connection's max payload: a reply's
// bytes on the wire are its body plus its headers.
const headroom = 1024

// Request is the paging part of a list request.
type Request struct {
	// Limit is the most items the page holds: 1 to [MaxLimit],
	// [DefaultLimit] when left out. A page may hold fewer when more would
	// not fit in one message; only an empty Next ends a walk.
	Limit int `json:"limit,omitempty"`
	// After is the Next of the previous page: the page starts with the
	// first item whose key sorts after it. Empty starts at the beginning.
	After string `json:"after,omitempty"`
}

// Budget is the most bytes a reply body may take on a connection whose
// server announced maxPayload: the max payload less room for headers.
func Budget(maxPayload int64) int {
	if maxPayload < 4*headroom {
		return int(maxPayload / 2)
	}
	return int(maxPayload - headroom)
}

// FirstAfter returns, in key order, the n items of all with the smallest
// keys greater than after (every such item when there are fewer). It holds
// n items at a time in a max-heap, so a page of a big fleet costs one pass
// over it, not a sort of it.
func FirstAfter[T any](all iter.Seq[T], key func(T) string, after string, n int) []T {
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

// TooBigError is returned by [Encode] when a single item does not fit in a
// reply of its own.
type TooBigError struct {
	Key    string // the item's key
	Budget int    // the reply budget it exceeds
}

func (e *TooBigError) Error() string {
	return fmt.Sprintf("%s alone does not fit in a reply under the server's max payload (%d bytes); list on after it with \"after\":%q",
		e.Key, e.Budget, e.Key)
}

// Encode writes the reply {"<field>":[items…],"next":"<key>"} in at most
// budget bytes. items are the candidates in key order: up to limit of them
// are taken, fewer when the next would not fit; Next is the key of the last
// item taken when any candidate is left, else "". An item too big for a
// reply of its own is a [*TooBigError]. Keys are written with
// strconv.Quote, so they must be valid UTF-8 without control characters.
func Encode[T any](field string, items []T, key func(T) string, limit, budget int) (json.RawMessage, error) {
	buf := make([]byte, 0, 4096)
	buf = append(buf, `{"`...)
	buf = append(buf, field...)
	buf = append(buf, `":[`...)
	n := 0
	for n < len(items) && n < limit {
		b, err := json.Marshal(items[n])
		if err != nil {
			return nil, fmt.Errorf("encode item %s: %w", key(items[n]), err)
		}
		sep := 0
		if n > 0 {
			sep = 1
		}
		// Room for the ending too, should this item be the page's last.
		tail := len(`],"next":}`) + len(strconv.Quote(key(items[n])))
		if len(buf)+sep+len(b)+tail > budget {
			if n == 0 {
				return nil, &TooBigError{Key: key(items[0]), Budget: budget}
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
