package apiserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
)

// Paging of the list replies (proxy.list, pool.list) follows package
// [page]: items ordered by key (proxy id, pool name), a cursor that is a
// key, every reply cut to fit the connection's max payload.

// check validates the paging fields of a request decoded with present (the
// keys it carried) and returns the limit to use. what names the key After
// holds ("proxy id", "pool name").
func checkPage(r api.PageRequest, present map[string]bool, what string) (int, []events.FieldError) {
	var fields []events.FieldError
	limit := page.DefaultLimit
	if present["limit"] {
		limit = r.Limit
		if limit < 1 || limit > page.MaxLimit {
			fields = append(fields, events.FieldError{Field: "limit",
				Reason: fmt.Sprintf("must be between 1 and %d", page.MaxLimit), Value: strconv.Itoa(r.Limit)})
		}
	}
	if r.After != "" && !events.IsIdentifier(r.After) {
		fields = append(fields, events.FieldError{Field: "after",
			Reason: `must be the "next" of a previous page, a ` + what + ` (` + events.IdentifierRule + `)`, Value: clip(r.After)})
	}
	return limit, fields
}

// ReplyBudget is the most bytes a reply body may take: the max payload the
// server announced to this connection, less room for headers.
func (s *Server) ReplyBudget() int {
	return page.Budget(s.nc.MaxPayload())
}

// pageJSON encodes a page as [page.Encode] does; what names an item ("proxy",
// "pool") in the error for one too big for any reply.
func pageJSON[T any](field string, items []T, key func(T) string, limit, budget int, what string) (json.RawMessage, *api.APIError) {
	raw, err := page.Encode(field, items, key, limit, budget)
	var big *page.TooBigError
	switch {
	case errors.As(err, &big):
		return nil, api.Internal(what + " " + big.Error())
	case err != nil:
		return nil, api.Internal("could not encode the page; retry")
	}
	return raw, nil
}
