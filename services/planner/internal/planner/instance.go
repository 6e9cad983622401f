package planner

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
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// instanceDeleteReason is the retiring reason recorded when an operator
// deletes an instance through instance.delete.
const instanceDeleteReason = "instance deleted by operator"

// instanceDelete deletes an instance no live proxy owns, typically one left
// behind on purpose by proxy.delete with skipCleanup. It asks the target's
// agent for its inventory and refuses an instance that is not listed (the
// inventory lists marked instances only, so an unmarked one is never
// found), whose marker names no proxy or another entry, or whose proxy is
// still live: such a proxy is deleted with proxy.delete. Otherwise it
// appends retiring to the proxy's aggregate (after its abandoned or
// deleted event; the planner's fold and the health views keep a finished
// proxy finished) and sends a delete command, which the agent executes
// because the proxy's last event is no longer terminal. The driver checks
// the marker again before it deletes. Repeating the request re-sends the
// same command (same Msg-Id).
func (p *Planner) instanceDelete(ctx context.Context, body []byte) (any, *api.APIError) {
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
		return nil, invalid(ve.Fields)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("entry", req.Entry),
		attribute.String("target", req.Target), attribute.String("instance", req.Name))
	where := req.Entry + "/" + req.Target

	list, err := p.requestInventory(ctx, agentSeen{Entry: req.Entry, Target: req.Target})
	if errors.Is(err, nats.ErrNoResponders) {
		return nil, unprocessable("target", fmt.Sprintf("no agent serves %s; start its agent to list and delete its instances", where), req.Target)
	}
	if err != nil {
		p.log.WarnContext(ctx, "instance.delete: inventory request", "entry", req.Entry, "target", req.Target, "err", err)
		return nil, &api.APIError{Status: "503", Code: api.CodeUnavailable,
			Message: "target: the agent of " + where + " did not answer the inventory request; retry"}
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
		return nil, unprocessable("name", "no marked instance of that name on "+where+
			" (its inventory lists only instances that carry the proxyfleet marker; unmarked instances are never touched)", req.Name)
	}
	id := inst.Marker.ProxyID
	switch {
	case id == "":
		return nil, unprocessable("name", "the instance carries no proxy id in its marker; unmarked instances are never touched", req.Name)
	case inst.Marker.Entry != req.Entry:
		return nil, unprocessable("name", "the instance's marker names entry "+strconv.Quote(inst.Marker.Entry)+", not "+strconv.Quote(req.Entry)+"; it is left alone", req.Name)
	case !events.IsIdentifier(id) || events.InstanceName(id) != inst.Name:
		return nil, unprocessable("name", "the instance's name does not derive from the proxy id in its marker; it is left alone", req.Name)
	}
	previous := "unknown"
	x, aerr := p.lookupProxy(ctx, id)
	switch {
	case aerr == nil:
		previous = x.State
	case aerr.Code != api.CodeNotFound:
		return nil, aerr
	}
	if previous != "unknown" && !events.IsTerminal(previous) {
		return nil, unprocessable("name", fmt.Sprintf("the instance belongs to proxy %s, which is %s; delete the proxy with fleet.api.proxy.delete instead", id, previous), req.Name)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))

	var attempt int
	var sent *commandInFlight
	if lerr := p.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
		if attempt, aerr = p.retireInstance(ctx, f, id); aerr != nil {
			return
		}
		cmd := events.DeleteCommand{
			ProxyID: id, Pool: inst.Marker.Pool, Entry: req.Entry, Target: req.Target, Instance: inst.Name,
			ProviderID: inst.ProviderID, Attempt: attempt, Reason: instanceDeleteReason,
		}
		sent = f.command(ctx, pending{del: &cmd})
	}); lerr != nil {
		return nil, lerr
	}
	if aerr != nil {
		return nil, aerr
	}
	if sent == nil || sent.err != nil {
		p.log.WarnContext(ctx, "instance.delete: publish delete", "proxy", id)
		return nil, internal("the deletion is recorded but its command could not be sent; send instance.delete again")
	}
	p.log.InfoContext(ctx, "instance delete sent", "proxy", id, "pool", inst.Marker.Pool, "entry", req.Entry,
		"target", req.Target, "instance", inst.Name, "previous", previous, "attempt", attempt)
	return api.InstanceDeleteReply{Entry: req.Entry, Target: req.Target, Name: inst.Name, ProxyID: id,
		Pool: inst.Marker.Pool, Attempt: attempt, Previous: previous}, nil
}

// retireInstance makes the proxy's last event retiring (appending it,
// expecting the aggregate's last sequence, unless it already is) and
// returns the delete attempt: the number of retiring events, so a repeated
// request re-sends the same command and a request after a failed delete
// sends a new one. This is the garbage collector's path for orphans (see
// [Planner.deleteOrphan]), open here to abandoned proxies too.
func (p *Planner) retireInstance(ctx context.Context, f *flight, id string) (int, *api.APIError) {
	for range maxConflictRetries {
		evs, err := p.store.Load(ctx, events.AggregateProxy, id)
		if err != nil {
			p.log.WarnContext(ctx, "instance.delete: read the proxy's events", "proxy", id, "err", err)
			return 0, internal("could not read the proxy's events; retry")
		}
		var lastSeq uint64
		lastKind, pool := "", ""
		retirings := 0
		for _, e := range evs {
			if e.Kind == events.ProxyRetiring {
				retirings++
			}
			lastSeq, lastKind = e.Seq, e.Kind
		}
		if lastKind == events.ProxyRetiring {
			return retirings, nil
		}
		if x, aerr := p.lookupProxy(ctx, id); aerr == nil {
			pool = x.Pool
		}
		d := events.ProxyRetiringData{Reason: instanceDeleteReason}
		u := f.decide(ctx, nil, pool, events.AggregateProxy, id, &bus.Expect{Seq: lastSeq},
			[]bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(id, events.ProxyRetiring, lastSeq, d), Data: d}},
			[]any{"proxy", id, "decision", events.ProxyRetiring, "reason", instanceDeleteReason}, nil)
		f.wait()
		if errors.Is(u.err, bus.ErrConflict) {
			continue // re-read: the collector or a repeated request got there first
		}
		if u.err != nil {
			p.log.ErrorContext(ctx, "instance.delete: append retiring", "proxy", id, "err", u.err)
			return 0, internal("could not record the deletion; retry")
		}
		return retirings + 1, nil
	}
	return 0, &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the proxy keeps changing concurrently; retry"}
}

// unprocessable refuses a well-formed request naming something that cannot
// be acted on: 422 naming field.
func unprocessable(field, reason, value string) *api.APIError {
	return invalid([]events.FieldError{{Field: field, Reason: reason, Value: value}})
}
