package api

import (
	"context"
	"encoding/json"
	"fmt"
	"iter"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// DefaultTimeout bounds one request of a [Client] made without
// [WithTimeout]: a little more than the 30s the planner gives the work
// behind one request, so its own answer about a slow request comes first.
const DefaultTimeout = 35 * time.Second

// Client calls the planner's API over a NATS connection. Every method
// sends one request (the list iterators one per page), bounded by the
// caller's context and by the client's timeout, carries the trace of ctx
// in its headers, and returns what [Decode] makes of the reply: the reply
// type, or an [*APIError] for a refusal, no responders and a timeout. A
// Client is safe for concurrent use.
type Client struct {
	nc      *nats.Conn
	timeout time.Duration
}

// Option configures a [Client].
type Option func(*Client)

// WithTimeout bounds each request (each page of a list) to d instead of
// [DefaultTimeout]; d <= 0 leaves the default.
func WithTimeout(d time.Duration) Option {
	return func(c *Client) {
		if d > 0 {
			c.timeout = d
		}
	}
}

// NewClient returns a client of the API on nc.
func NewClient(nc *nats.Conn, opts ...Option) *Client {
	c := &Client{nc: nc, timeout: DefaultTimeout}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Request sends body as it is on subject and decodes the reply into out
// (nil to ignore it) with [Decode]. The typed methods are built on it; call
// it for a body no request type can express, such as the malformed ones a
// test of the planner's decoding sends.
func (c *Client) Request(ctx context.Context, subject string, body []byte, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	msg := nats.NewMsg(subject)
	msg.Data = body
	telemetry.Inject(ctx, msg.Header)
	reply, err := c.nc.RequestMsgWithContext(ctx, msg)
	return Decode(subject, reply, err, out)
}

// call sends req, encoded as JSON, to fleet.api.<noun>.<verb>.
func call[T any](ctx context.Context, c *Client, noun, verb string, req any) (T, error) {
	var out T
	subject := events.APISubject(noun, verb)
	body, err := json.Marshal(req)
	if err != nil {
		return out, fmt.Errorf("%s: encode the request: %w", subject, err)
	}
	err = c.Request(ctx, subject, body, &out)
	return out, err
}

// PoolApply applies spec (pool.apply): it creates the pool or records its
// next revision, and answers the pool. Re-applying an unchanged spec
// records nothing.
func (c *Client) PoolApply(ctx context.Context, spec events.PoolSpec) (PoolView, error) {
	return call[PoolView](ctx, c, NounPool, VerbApply, spec)
}

// PoolGet returns the pool named name (pool.get).
func (c *Client) PoolGet(ctx context.Context, name string) (PoolView, error) {
	return call[PoolView](ctx, c, NounPool, VerbGet, NameRequest{Name: name})
}

// PoolDelete deletes the pool named name (pool.delete): the planner retires
// its proxies. Deleting a deleted pool changes nothing.
func (c *Client) PoolDelete(ctx context.Context, name string) (PoolView, error) {
	return call[PoolView](ctx, c, NounPool, VerbDelete, NameRequest{Name: name})
}

// PoolList walks the pools in name order (pool.list), a page of at most
// req.Limit at a time, from req.After on. A failed page is yielded as the
// error and ends the walk.
func (c *Client) PoolList(ctx context.Context, req PoolListRequest) iter.Seq2[PoolView, error] {
	at := func(after string) any { r := req; r.After = after; return r }
	return walk(ctx, c, NounPool, req.After, at, func(l PoolList) ([]PoolView, string) { return l.Pools, l.Next })
}

// ProxyGet returns the proxy with id (proxy.get), also one that finished
// long ago.
func (c *Client) ProxyGet(ctx context.Context, id string) (events.ProxyView, error) {
	return call[events.ProxyView](ctx, c, NounProxy, VerbGet, ProxyRequest{ID: id})
}

// ProxyList walks the live proxies in id order (proxy.list), of req.Pool
// or of every pool, a page of at most req.Limit at a time, from req.After
// on. A failed page is yielded as the error and ends the walk.
func (c *Client) ProxyList(ctx context.Context, req ProxyListRequest) iter.Seq2[events.ProxyView, error] {
	at := func(after string) any { r := req; r.After = after; return r }
	return walk(ctx, c, NounProxy, req.After, at, func(l ProxyList) ([]events.ProxyView, string) { return l.Proxies, l.Next })
}

// ProxyDelete retires a proxy and deletes its instance (proxy.delete), or
// with SkipCleanup abandons it and leaves the instance in place.
func (c *Client) ProxyDelete(ctx context.Context, req ProxyDeleteRequest) (events.ProxyView, error) {
	return call[events.ProxyView](ctx, c, NounProxy, VerbDelete, req)
}

// Recycle replaces a proxy (proxy.recycle): surge first, or at once with
// Now.
func (c *Client) Recycle(ctx context.Context, req ProxyRecycleRequest) (events.ProxyView, error) {
	return call[events.ProxyView](ctx, c, NounProxy, VerbRecycle, req)
}

// ReportBan reports a proxy banned by a site (proxy.report-ban): the
// planner retires it at once and requests its replacement.
func (c *Client) ReportBan(ctx context.Context, req ProxyBanRequest) (events.ProxyView, error) {
	return call[events.ProxyView](ctx, c, NounProxy, VerbReportBan, req)
}

// InstanceDelete deletes an instance no live proxy owns (instance.delete),
// typically one proxy.delete left behind with SkipCleanup.
func (c *Client) InstanceDelete(ctx context.Context, req InstanceDeleteRequest) (InstanceDeleteReply, error) {
	return call[InstanceDeleteReply](ctx, c, NounInstance, VerbDelete, req)
}

// walk yields the items of the pages of noun.list from after on: it
// sends at(after), then at(next) with each page's Next until a page's Next
// is "". A Next that does not sort after the page's After ends the walk
// with an error rather than looping.
func walk[L, T any](ctx context.Context, c *Client, noun, after string, at func(after string) any, items func(L) ([]T, string)) iter.Seq2[T, error] {
	return func(yield func(T, error) bool) {
		var zero T
		for after := after; ; {
			l, err := call[L](ctx, c, noun, VerbList, at(after))
			if err != nil {
				yield(zero, err)
				return
			}
			got, next := items(l)
			for _, x := range got {
				if !yield(x, nil) {
					return
				}
			}
			if next == "" {
				return
			}
			if next <= after {
				yield(zero, fmt.Errorf("%s: the page after %q names next %q, which does not move forward", events.APISubject(noun, VerbList), after, next))
				return
			}
			after = next
		}
	}
}
