package apiserver

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// lookupProxy returns the proxy with id, or a 422.
func (s *Server) lookupProxy(ctx context.Context, id string) (events.ProxyView, *api.APIError) {
	if aerr := checkIdentifier("id", id); aerr != nil {
		return events.ProxyView{}, aerr
	}
	return s.b.Proxy(ctx, id)
}

func (s *Server) proxyGet(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	x, aerr := s.lookupProxy(ctx, req.ID)
	if aerr != nil {
		return nil, aerr
	}
	return x, nil
}

// proxyList answers one page of the live proxies (not deleted or
// abandoned), of one pool or of all, in id order.
func (s *Server) proxyList(_ context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyListRequest
	present, aerr := decodeStrictPresent(body, &req, true)
	if aerr != nil {
		return nil, aerr
	}
	limit, fields := checkPage(req.PageRequest, present, "proxy id")
	if req.Pool != "" {
		if fe := events.CheckIdentifier("pool", req.Pool); fe != nil {
			fields = append([]events.FieldError{*fe}, fields...)
		}
	}
	if len(fields) > 0 {
		return nil, api.Invalid(fields)
	}
	if req.Pool != "" {
		if _, aerr := s.lookupPool("pool", req.Pool); aerr != nil {
			return nil, aerr
		}
	}
	views := s.b.Proxies(req.Pool, req.After, limit+1)
	return pageJSON("proxies", views, func(v events.ProxyView) string { return v.ID }, limit, s.ReplyBudget(), "proxy")
}

// retire has the writer retire the proxy with id as r says.
func (s *Server) retire(ctx context.Context, id string, r Retirement) (any, *api.APIError) {
	if aerr := checkIdentifier("id", id); aerr != nil {
		return nil, aerr
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))
	return s.b.Retire(ctx, id, r)
}

func (s *Server) proxyDelete(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyDeleteRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	reason := "deleted by operator"
	if req.SkipCleanup {
		reason = "deleted by operator, cleanup skipped"
	}
	return s.retire(ctx, req.ID, Retirement{Reason: reason, SkipCleanup: req.SkipCleanup})
}

// proxyRecycle replaces a proxy surge first (a replacement now, the proxy
// retired once it is ready) or, with now, retires it at once for the fill
// to replace.
func (s *Server) proxyRecycle(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyRecycleRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	if req.Now {
		return s.retire(ctx, req.ID, Retirement{Reason: "recycled by operator"})
	}
	if aerr := checkIdentifier("id", req.ID); aerr != nil {
		return nil, aerr
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", req.ID))
	return s.b.Recycle(ctx, req.ID)
}

// proxyReportBan retires a proxy whose egress is banned at once, recording
// the ban in the retiring reason ("banned: <reason>"), and requests its
// replacement in the same request, so the pool does not wait a reconcile
// round. When no target can take the replacement now, the proxy is retired
// all the same and the pool's Placed condition says why it stays short.
func (s *Server) proxyReportBan(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyBanRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	reason := strings.TrimSpace(req.Reason)
	if reason == "" {
		reason = "reported"
	}
	if len(reason) > api.MaxBanReason {
		return nil, api.Invalid([]events.FieldError{{Field: "reason", Reason: fmt.Sprintf("must be at most %d bytes", api.MaxBanReason)}})
	}
	return s.retire(ctx, req.ID, Retirement{Reason: "banned: " + reason, Replace: true})
}
