package apiserver

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// instanceDelete deletes an instance no live proxy owns, typically one left
// behind on purpose by proxy.delete with skipCleanup. It asks the target's
// agent for its inventory and refuses an instance that is not listed (the
// inventory lists marked instances only, so an unmarked one is never
// found), whose marker names no proxy or another entry, or whose proxy is
// still live: such a proxy is deleted with proxy.delete. Otherwise the
// writer appends retiring to the proxy's aggregate (after its abandoned or
// deleted event; the planner's fold and the health views keep a finished
// proxy finished) and sends a delete command, which the agent executes
// because the proxy's last event is no longer terminal. The driver checks
// the marker again before it deletes. Repeating the request re-sends the
// same command (same Msg-Id).
func (s *Server) instanceDelete(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.InstanceDeleteRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	var v events.ValidationError
	v.AddField(events.CheckIdentifier("entry", req.Entry))
	v.AddField(events.CheckIdentifier("target", req.Target))
	v.AddField(events.CheckIdentifier("name", req.Name))
	var ve *events.ValidationError
	if err := v.Err(); errors.As(err, &ve) {
		return nil, api.Invalid(ve.Fields)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("entry", req.Entry),
		attribute.String("target", req.Target), attribute.String("instance", req.Name))
	where := req.Entry + "/" + req.Target

	list, err := s.b.Inventory(ctx, req.Entry, req.Target)
	if errors.Is(err, nats.ErrNoResponders) {
		return nil, api.Unprocessable("target", fmt.Sprintf("no agent serves %s; start its agent to list and delete its instances", where), req.Target)
	}
	if err != nil {
		s.log.WarnContext(ctx, "instance.delete: inventory request", "entry", req.Entry, "target", req.Target, "err", err)
		return nil, api.Unavailable("target: the agent of " + where + " did not answer the inventory request; retry")
	}
	var inst agent.Instance
	found := false
	for _, i := range list {
		if i.Name == req.Name {
			inst, found = i, true
			break
		}
	}
	if !found {
		return nil, api.Unprocessable("name", "no marked instance of that name on "+where+
			" (its inventory lists only instances that carry the proxyfleet marker; unmarked instances are never touched)", req.Name)
	}
	id := inst.Marker.ProxyID
	switch {
	case id == "":
		return nil, api.Unprocessable("name", "the instance carries no proxy id in its marker; unmarked instances are never touched", req.Name)
	case inst.Marker.Entry != req.Entry:
		return nil, api.Unprocessable("name", "the instance's marker names entry "+strconv.Quote(inst.Marker.Entry)+", not "+strconv.Quote(req.Entry)+"; it is left alone", req.Name)
	case !events.IsIdentifier(id) || events.InstanceName(id) != inst.Name:
		return nil, api.Unprocessable("name", "the instance's name does not derive from the proxy id in its marker; it is left alone", req.Name)
	}
	previous := "unknown"
	x, aerr := s.b.Proxy(ctx, id)
	switch {
	case aerr == nil:
		previous = x.State
	case aerr.Code != api.CodeNotFound:
		return nil, aerr
	}
	if previous != "unknown" && !events.IsTerminal(previous) {
		return nil, api.Unprocessable("name", fmt.Sprintf("the instance belongs to proxy %s, which is %s; delete the proxy with fleet.api.proxy.delete instead", id, previous), req.Name)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))
	attempt, aerr := s.b.DeleteInstance(ctx, req.Entry, req.Target, inst)
	if aerr != nil {
		return nil, aerr
	}
	s.log.InfoContext(ctx, "instance delete sent", "proxy", id, "pool", inst.Marker.Pool, "entry", req.Entry,
		"target", req.Target, "instance", inst.Name, "previous", previous, "attempt", attempt)
	return api.InstanceDeleteReply{Entry: req.Entry, Target: req.Target, Name: inst.Name, ProxyID: id,
		Pool: inst.Marker.Pool, Attempt: attempt, Previous: previous}, nil
}
