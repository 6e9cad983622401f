package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
)

// fakePlanner answers the API as the planner does, over a map of pools and
// proxies: replies are the API's types, refusals a micro error with an
// [api.ErrorBody]. It records the last request's headers per endpoint.
type fakePlanner struct {
	mu      sync.Mutex
	pools   map[string]api.PoolView
	proxies map[string]events.ProxyView
	headers map[string]nats.Header
	// hold is an endpoint that never answers, for timeouts.
	hold chan struct{}
}

func startPlanner(t *testing.T, nc *nats.Conn) *fakePlanner {
	t.Helper()
	f := &fakePlanner{pools: map[string]api.PoolView{}, proxies: map[string]events.ProxyView{},
		headers: map[string]nats.Header{}, hold: make(chan struct{})}
	svc, err := micro.AddService(nc, micro.Config{Name: "fleet-planner", Version: "0.0.0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		close(f.hold)
		_ = svc.Stop()
	})
	type handler func(body []byte) (any, *api.APIError)
	for _, e := range []struct {
		noun, verb string
		fn         handler
	}{
		{api.NounPool, api.VerbApply, f.poolApply},
		{api.NounPool, api.VerbGet, f.poolGet},
		{api.NounPool, api.VerbDelete, f.poolDelete},
		{api.NounPool, api.VerbList, f.poolList},
		{api.NounProxy, api.VerbGet, f.proxyGet},
		{api.NounProxy, api.VerbList, f.proxyList},
		{api.NounProxy, api.VerbDelete, f.proxyRetire("deleted by operator")},
		{api.NounProxy, api.VerbRecycle, f.proxyRetire("recycled by operator")},
		{api.NounProxy, api.VerbReportBan, f.proxyBan},
		{api.NounInstance, api.VerbDelete, f.instanceDelete},
	} {
		name := e.noun + "." + e.verb
		err := svc.AddEndpoint(e.noun+"-"+e.verb, micro.HandlerFunc(func(req micro.Request) {
			f.mu.Lock()
			f.headers[name] = nats.Header(req.Headers())
			out, aerr := e.fn(req.Data())
			f.mu.Unlock()
			if aerr != nil {
				_ = req.Error(aerr.Status, aerr.Message, api.ErrorBody(aerr))
				return
			}
			_ = req.RespondJSON(out)
		}), micro.WithEndpointSubject(events.APISubject(e.noun, e.verb)))
		if err != nil {
			t.Fatal(err)
		}
	}
	// fleet.api.pool.hold takes requests and never answers them.
	err = svc.AddEndpoint("pool-hold", micro.HandlerFunc(func(micro.Request) { <-f.hold }),
		micro.WithEndpointSubject(events.APISubject(api.NounPool, "hold")))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func decode(body []byte, out any) *api.APIError {
	if err := json.Unmarshal(body, out); err != nil {
		return &api.APIError{Status: "400", Code: api.CodeBadRequest, Message: "(body): " + err.Error()}
	}
	return nil
}

func unknown(field, what, value string) *api.APIError {
	return &api.APIError{Status: "422", Code: api.CodeNotFound, Message: field + ": " + what + " " + strconv.Quote(value),
		Fields: []events.FieldError{{Field: field, Reason: what, Value: value}}}
}

func (f *fakePlanner) poolApply(body []byte) (any, *api.APIError) {
	var spec events.PoolSpec
	if aerr := decode(body, &spec); aerr != nil {
		return nil, aerr
	}
	if fe := events.CheckIdentifier("name", spec.Name); fe != nil {
		return nil, &api.APIError{Status: "422", Code: api.CodeInvalid, Message: fe.Error(), Fields: []events.FieldError{*fe}}
	}
	v := f.pools[spec.Name]
	spec.Auth = nil // secrets are never answered
	v.Name, v.Spec, v.Size, v.Revision = spec.Name, spec, spec.Size, v.Revision+1
	for i := range spec.Size {
		id := spec.Name + "-" + strconv.Itoa(i)
		f.proxies[id] = events.ProxyView{ID: id, Pool: spec.Name, State: events.ProxyRequested}
	}
	f.pools[spec.Name] = v
	return v, nil
}

func (f *fakePlanner) poolGet(body []byte) (any, *api.APIError) {
	var req api.NameRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	v, ok := f.pools[req.Name]
	if !ok {
		return nil, unknown("name", "unknown pool", req.Name)
	}
	return v, nil
}

func (f *fakePlanner) poolDelete(body []byte) (any, *api.APIError) {
	out, aerr := f.poolGet(body)
	if aerr != nil {
		return nil, aerr
	}
	v := out.(api.PoolView)
	v.Deleted = true
	f.pools[v.Name] = v
	return v, nil
}

// list answers one page of items in key order after req's After.
func list[T any](items []T, key func(T) string, req api.PageRequest) ([]T, string) {
	limit := req.Limit
	if limit == 0 {
		limit = page.DefaultLimit
	}
	slices.SortFunc(items, func(a, b T) int {
		if key(a) < key(b) {
			return -1
		}
		return 1
	})
	var out []T
	for _, x := range items {
		if key(x) > req.After {
			out = append(out, x)
		}
	}
	if len(out) > limit {
		return out[:limit], key(out[limit-1])
	}
	return out, ""
}

func (f *fakePlanner) poolList(body []byte) (any, *api.APIError) {
	var req api.PoolListRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	var all []api.PoolView
	for _, v := range f.pools {
		all = append(all, v)
	}
	pools, next := list(all, func(v api.PoolView) string { return v.Name }, req.PageRequest)
	return api.PoolList{Pools: pools, Next: next}, nil
}

func (f *fakePlanner) proxyGet(body []byte) (any, *api.APIError) {
	var req api.ProxyRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	x, ok := f.proxies[req.ID]
	if !ok {
		return nil, unknown("id", "unknown proxy", req.ID)
	}
	return x, nil
}

func (f *fakePlanner) proxyList(body []byte) (any, *api.APIError) {
	var req api.ProxyListRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	if _, ok := f.pools[req.Pool]; req.Pool != "" && !ok {
		return nil, unknown("pool", "unknown pool", req.Pool)
	}
	var all []events.ProxyView
	for _, x := range f.proxies {
		if req.Pool == "" || x.Pool == req.Pool {
			all = append(all, x)
		}
	}
	proxies, next := list(all, func(x events.ProxyView) string { return x.ID }, req.PageRequest)
	return api.ProxyList{Proxies: proxies, Next: next}, nil
}

func (f *fakePlanner) retire(id, reason string) (any, *api.APIError) {
	x, ok := f.proxies[id]
	if !ok {
		return nil, unknown("id", "unknown proxy", id)
	}
	if x.State != events.ProxyRetiring {
		x.State, x.Reason = events.ProxyRetiring, reason
		f.proxies[id] = x
	}
	return x, nil
}

func (f *fakePlanner) proxyRetire(reason string) func([]byte) (any, *api.APIError) {
	return func(body []byte) (any, *api.APIError) {
		var req api.ProxyRequest
		if aerr := decode(body, &req); aerr != nil {
			return nil, aerr
		}
		return f.retire(req.ID, reason)
	}
}

func (f *fakePlanner) proxyBan(body []byte) (any, *api.APIError) {
	var req api.ProxyBanRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	return f.retire(req.ID, "banned: "+req.Reason)
}

func (f *fakePlanner) instanceDelete(body []byte) (any, *api.APIError) {
	var req api.InstanceDeleteRequest
	if aerr := decode(body, &req); aerr != nil {
		return nil, aerr
	}
	for _, x := range f.proxies {
		if events.InstanceName(x.ID) == req.Name {
			return api.InstanceDeleteReply{Entry: req.Entry, Target: req.Target, Name: req.Name, ProxyID: x.ID,
				Pool: x.Pool, Attempt: 1, Previous: x.State}, nil
		}
	}
	return nil, &api.APIError{Status: "422", Code: api.CodeInvalid, Message: "name: no marked instance of that name",
		Fields: []events.FieldError{{Field: "name", Reason: "no marked instance of that name", Value: req.Name}}}
}

func (f *fakePlanner) header(endpoint string) nats.Header {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.headers[endpoint]
}

func collect[T any](t *testing.T, seq func(func(T, error) bool)) []T {
	t.Helper()
	var out []T
	for x, err := range seq {
		if err != nil {
			t.Fatalf("walk: %v", err)
		}
		out = append(out, x)
	}
	return out
}

func TestClient(t *testing.T) {
	conn := bustest.Start(t)
	startPlanner(t, conn.NC)
	c := api.NewClient(conn.NC)
	ctx := context.Background()

	for _, name := range []string{"c", "a", "b"} {
		v, err := c.PoolApply(ctx, events.PoolSpec{Name: name, Provider: "local", Size: 2, Auth: &events.ProxyAuth{Username: "u", Password: "secret"}})
		if err != nil {
			t.Fatalf("PoolApply %s: %v", name, err)
		}
		if v.Name != name || v.Revision != 1 || v.Size != 2 || v.Spec.Auth != nil {
			t.Fatalf("PoolApply %s: got %+v, want revision 1 of size 2 without secrets", name, v)
		}
	}
	_, err := c.PoolApply(ctx, events.PoolSpec{Name: "Not A Name", Provider: "local"})
	var aerr *api.APIError
	if !errors.As(err, &aerr) || aerr.Status != "422" || !errors.Is(err, api.ErrInvalid) || len(aerr.Fields) != 1 || aerr.Fields[0].Field != "name" {
		t.Fatalf("PoolApply of a bad name: got %#v, want a 422 invalid naming the field name", err)
	}

	if v, err := c.PoolGet(ctx, "b"); err != nil || v.Name != "b" {
		t.Fatalf("PoolGet b: got %+v, %v", v, err)
	}
	if _, err := c.PoolGet(ctx, "nope"); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("PoolGet nope: got %v, want not found", err)
	}

	// Pages of 2 over 3 pools: the walk follows next across pages.
	var names []string
	for _, v := range collect(t, c.PoolList(ctx, api.PoolListRequest{PageRequest: api.PageRequest{Limit: 2}})) {
		names = append(names, v.Name)
	}
	if want := []string{"a", "b", "c"}; !slices.Equal(names, want) {
		t.Fatalf("PoolList: got %v, want %v", names, want)
	}
	names = nil
	for _, v := range collect(t, c.PoolList(ctx, api.PoolListRequest{PageRequest: api.PageRequest{Limit: 1, After: "a"}})) {
		names = append(names, v.Name)
	}
	if want := []string{"b", "c"}; !slices.Equal(names, want) {
		t.Fatalf("PoolList after a: got %v, want %v", names, want)
	}
	// Breaking out of the walk stops it.
	n := 0
	for range c.PoolList(ctx, api.PoolListRequest{PageRequest: api.PageRequest{Limit: 1}}) {
		n++
		break
	}
	if n != 1 {
		t.Fatalf("PoolList with break: %d items, want 1", n)
	}

	var ids []string
	for _, x := range collect(t, c.ProxyList(ctx, api.ProxyListRequest{Pool: "b", PageRequest: api.PageRequest{Limit: 1}})) {
		ids = append(ids, x.ID)
	}
	if want := []string{"b-0", "b-1"}; !slices.Equal(ids, want) {
		t.Fatalf("ProxyList of b: got %v, want %v", ids, want)
	}
	if got := collect(t, c.ProxyList(ctx, api.ProxyListRequest{})); len(got) != 6 {
		t.Fatalf("ProxyList: got %d proxies, want 6", len(got))
	}
	for x, err := range c.ProxyList(ctx, api.ProxyListRequest{Pool: "nope"}) {
		if !errors.Is(err, api.ErrNotFound) || x.ID != "" {
			t.Fatalf("ProxyList of an unknown pool: got %+v, %v; want only not found", x, err)
		}
	}

	if x, err := c.ProxyGet(ctx, "a-0"); err != nil || x.Pool != "a" {
		t.Fatalf("ProxyGet a-0: got %+v, %v", x, err)
	}
	for _, call := range []struct {
		name string
		fn   func() (events.ProxyView, error)
		id   string
		want string
	}{
		{"ProxyDelete", func() (events.ProxyView, error) {
			return c.ProxyDelete(ctx, api.ProxyDeleteRequest{ID: "a-0", SkipCleanup: true})
		}, "a-0", "deleted by operator"},
		{"Recycle", func() (events.ProxyView, error) {
			return c.Recycle(ctx, api.ProxyRecycleRequest{ID: "a-1", Now: true})
		}, "a-1", "recycled by operator"},
		{"ReportBan", func() (events.ProxyView, error) {
			return c.ReportBan(ctx, api.ProxyBanRequest{ID: "b-0", Reason: "403 from example.com"})
		}, "b-0", "banned: 403 from example.com"},
	} {
		x, err := call.fn()
		if err != nil || x.ID != call.id || x.State != events.ProxyRetiring || x.Reason != call.want {
			t.Errorf("%s: got %+v, %v; want %s retiring %q", call.name, x, err, call.id, call.want)
		}
	}
	if _, err := c.ReportBan(ctx, api.ProxyBanRequest{ID: "gone"}); !errors.Is(err, api.ErrNotFound) {
		t.Errorf("ReportBan of an unknown proxy: got %v, want not found", err)
	}

	rep, err := c.InstanceDelete(ctx, api.InstanceDeleteRequest{Entry: "local", Target: "t1", Name: events.InstanceName("c-1")})
	if err != nil || rep.ProxyID != "c-1" || rep.Pool != "c" || rep.Previous != events.ProxyRequested {
		t.Fatalf("InstanceDelete: got %+v, %v", rep, err)
	}

	if v, err := c.PoolDelete(ctx, "c"); err != nil || !v.Deleted {
		t.Fatalf("PoolDelete c: got %+v, %v", v, err)
	}
}

// TestClientTrace: a request carries the trace of its context.
func TestClientTrace(t *testing.T) {
	conn := bustest.Start(t)
	fake := startPlanner(t, conn.NC)
	c := api.NewClient(conn.NC)
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true}))
	if _, err := c.PoolApply(ctx, events.PoolSpec{Name: "traced", Provider: "local", Size: 1}); err != nil {
		t.Fatal(err)
	}
	const want = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	if got := fake.header("pool.apply").Get("traceparent"); got != want {
		t.Fatalf("traceparent: got %q, want %q", got, want)
	}
}

// TestClientNoReply: no planner and a planner that does not answer are
// typed errors, and the caller's context bounds a request.
func TestClientNoReply(t *testing.T) {
	conn := bustest.Start(t)
	ctx := context.Background()

	_, err := api.NewClient(conn.NC).PoolGet(ctx, "a")
	var aerr *api.APIError
	if !errors.As(err, &aerr) || aerr.Status != "503" || !errors.Is(err, api.ErrUnavailable) || !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("no planner: got %#v, want a 503 unavailable wrapping no responders", err)
	}

	startPlanner(t, conn.NC)
	hold := events.APISubject(api.NounPool, "hold")
	start := time.Now()
	err = api.NewClient(conn.NC, api.WithTimeout(200*time.Millisecond)).Request(ctx, hold, []byte(`{}`), nil)
	if !errors.As(err, &aerr) || aerr.Status != "504" || !errors.Is(err, api.ErrTimeout) || !aerr.Retryable() {
		t.Fatalf("no answer: got %#v, want a retryable 504 timeout", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the timeout took %s, want about 200ms", d)
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	err = api.NewClient(conn.NC).Request(cctx, hold, []byte(`{}`), nil)
	if !errors.Is(err, context.Canceled) || errors.As(err, &aerr) {
		t.Fatalf("cancelled: got %#v, want context.Canceled and no *APIError", err)
	}
}
