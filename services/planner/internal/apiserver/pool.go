package apiserver

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// poolApply accepts a pool spec: it reads and checks it, then the writer
// records it (its secrets in fleet-secrets, pool applied with the next
// revision). An unchanged spec appends nothing.
func (s *Server) poolApply(ctx context.Context, body []byte) (any, *api.APIError) {
	var spec events.PoolSpec
	present, aerr := decodeStrictPresent(body, &spec, false)
	if aerr != nil {
		return nil, aerr
	}
	required := presence(&spec, present)
	spec.Normalize()
	if aerr := s.validateSpec(ctx, &spec, required...); aerr != nil {
		return nil, aerr
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("pool", spec.Name))
	return s.b.ApplyPool(ctx, spec)
}

// presence finds what only the request's keys tell: a field that is
// required though its zero value decodes, and a field sent as the zero
// value that otherwise means "the default" (which would be stored as the
// default, not refused as the out-of-range value it is).
func presence(spec *events.PoolSpec, present map[string]bool) []events.FieldError {
	var v events.ValidationError
	if !present["size"] && spec.Provider != events.ProviderExternal {
		// (An external pool's size is its list's length.)
		// encoding/json would leave it 0: a re-apply that forgot the size
		// must not empty the pool.
		v.Add("size", "is required (send 0 to empty the pool)", "")
	}
	if present["unhealthyAfter"] && spec.UnhealthyAfter == 0 {
		v.Add("unhealthyAfter", "must be at least "+events.MinUnhealthyAfter.String()+" (leave it out for the default "+events.DefaultUnhealthyAfter.String()+")", "0s")
	}
	if g := spec.Gateway; g != nil {
		for i, r := range g.BanRules {
			f := fmt.Sprintf("gateway.banRules[%d]", i)
			if present[f+".threshold"] && r.Threshold == 0 {
				v.Add(f+".threshold", fmt.Sprintf("must be 1 or more (leave it out for the default %d)", r.ThresholdOrDefault()), "0")
			}
			if present[f+".window"] && r.Window == 0 {
				v.Add(f+".window", "must be at least 1s (leave it out for the default "+events.DefaultBanWindow.String()+")", "0s")
			}
			if present[f+".cooldown"] && r.Cooldown == 0 {
				v.Add(f+".cooldown", "must be at least "+events.MinBanCooldown.String()+" (leave it out for the default "+events.DefaultBanCooldown.String()+")", "0s")
			}
		}
		if present["gateway.retireAfterSitesWindow"] && g.RetireAfterSitesWindow == 0 {
			v.Add("gateway.retireAfterSitesWindow", "must be at least "+events.MinRetireAfterSitesWindow.String()+" (leave it out for the default "+events.DefaultRetireAfterSitesWindow.String()+")", "0s")
		}
	}
	if spec.Autoscale != nil {
		for _, k := range []string{"min", "max", "targetConnections"} {
			if !present["autoscale."+k] {
				v.Add("autoscale."+k, "is required", "")
			}
		}
	}
	return v.Fields
}

// validateSpec checks the spec's fields, then that its targets are known
// to the fleet when one of its entries (provider and placement.entries) is. A pool of an entry no agent has
// announced yet is accepted, as desired state is: its Placed condition
// says that no agent of the entry ever announced itself, and it fills once
// one does (a malformed entry name is still refused). found lists the
// problems the request's keys showed (see [presence]); they are reported
// first, and stand for what the spec's own check says of the same fields.
func (s *Server) validateSpec(ctx context.Context, spec *events.PoolSpec, found ...events.FieldError) *api.APIError {
	fields := append([]events.FieldError(nil), found...)
	named := map[string]bool{}
	for _, f := range found {
		named[f.Field] = true
	}
	var ve *events.ValidationError
	if err := spec.Validate(); errors.As(err, &ve) {
		for _, f := range ve.Fields {
			if !named[f.Field] {
				fields = append(fields, f)
			}
		}
	} else if err != nil {
		fields = append(fields, events.FieldError{Field: bodyPath, Reason: err.Error()})
	}
	bad := map[string]bool{}
	for _, f := range fields {
		bad[f.Field] = true
	}
	entries := []string{spec.Provider}
	for i, e := range spec.PlacementEntries()[1:] {
		if !bad[fmt.Sprintf("placement.entries[%d]", i)] && !bad["placement.entries"] {
			entries = append(entries, e)
		}
	}
	if !bad["provider"] {
		fields = append(fields, s.unknownTargets(ctx, spec, entries, bad)...)
	}
	if p := spec.Placement; p != nil && !bad["provider"] {
		fields = append(fields, s.unknownLabels(ctx, entries, p, bad)...)
	}
	if len(fields) > 0 {
		return api.Invalid(fields)
	}
	return nil
}

// unknownTargets refuses each of the spec's targets that no entry of the
// pool (entries: its provider and its further placement entries) knows,
// once one of them is known: a target of a known entry that no agent
// announced is most likely a typo; it is refused, naming the known ones.
// bad holds the fields already refused.
func (s *Server) unknownTargets(ctx context.Context, spec *events.PoolSpec, entries []string, bad map[string]bool) []events.FieldError {
	all := map[string]bool{}
	anyKnown := false
	for _, e := range entries {
		targets, known := s.b.Targets(ctx, e, spec.Targets)
		if !known {
			continue
		}
		anyKnown = true
		for t := range targets {
			all[t] = true
		}
	}
	if !anyKnown {
		return nil
	}
	var out []events.FieldError
	for i, t := range spec.Targets {
		f := fmt.Sprintf("targets[%d]", i)
		if !bad[f] && !all[t] {
			out = append(out, events.FieldError{Field: f,
				Reason: "not a target of " + entriesText(entries) + " (known: " + strings.Join(slices.Sorted(maps.Keys(all)), ", ") + ")", Value: t})
		}
	}
	return out
}

// entriesText names a pool's entries: "entry local", "entries local, cloud".
func entriesText(entries []string) string {
	if len(entries) == 1 {
		return "entry " + entries[0]
	}
	return "entries " + strings.Join(entries, ", ")
}

// unknownLabels refuses each label key placement p names that no live
// target of the pool's entries carries: most likely a typo, and a pool
// that could place nothing. While no target of those entries is live
// nothing is refused, as for a pool of an entry no agent announced yet.
// bad holds the fields already refused.
func (s *Server) unknownLabels(ctx context.Context, entries []string, p *events.Placement, bad map[string]bool) []events.FieldError {
	keys := map[string]bool{}
	live := false
	for _, e := range entries {
		k, l := s.b.LabelKeys(ctx, e)
		live = live || l
		for key := range k {
			keys[key] = true
		}
	}
	if !live {
		return nil
	}
	known := strings.Join(slices.Sorted(maps.Keys(keys)), ", ")
	if known == "" {
		known = "none"
	}
	reason := "no live target of " + entriesText(entries) + " carries this label (their labels: " + known + "); label the agents first"
	var out []events.FieldError
	for _, k := range slices.Sorted(maps.Keys(p.Require)) {
		if f := "placement.require." + k; events.IsLabel(k) && !keys[k] && !bad[f] {
			out = append(out, events.FieldError{Field: f, Reason: reason, Value: k})
		}
	}
	for i, sp := range p.Spread {
		if f := fmt.Sprintf("placement.spread[%d].label", i); events.IsLabel(sp.Label) && !keys[sp.Label] && !bad[f] {
			out = append(out, events.FieldError{Field: f, Reason: reason, Value: sp.Label})
		}
	}
	return out
}

// checkIdentifier refuses a name or id that no pool or proxy can have.
func checkIdentifier(field, value string) *api.APIError {
	if fe := events.CheckIdentifier(field, value); fe != nil {
		return api.Invalid([]events.FieldError{*fe})
	}
	return nil
}

// lookupPool returns the view of the applied pool name, or a 422.
func (s *Server) lookupPool(field, name string) (api.PoolView, *api.APIError) {
	if aerr := checkIdentifier(field, name); aerr != nil {
		return api.PoolView{}, aerr
	}
	v, ok := s.b.Pool(name)
	if !ok {
		return api.PoolView{}, api.NotFound(field, "unknown pool", name)
	}
	return v, nil
}

func (s *Server) poolGet(_ context.Context, body []byte) (any, *api.APIError) {
	var req api.NameRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	v, aerr := s.lookupPool("name", req.Name)
	if aerr != nil {
		return nil, aerr
	}
	return v, nil
}

// poolList answers one page of the pools an operator can see: applied
// ones, and deleted ones until their last proxy is gone.
func (s *Server) poolList(_ context.Context, body []byte) (any, *api.APIError) {
	var req api.PoolListRequest
	present, aerr := decodeStrictPresent(body, &req, true)
	if aerr != nil {
		return nil, aerr
	}
	limit, fields := checkPage(req.PageRequest, present, "pool name")
	if len(fields) > 0 {
		return nil, api.Invalid(fields)
	}
	views := s.b.Pools(req.After, limit+1)
	return pageJSON("pools", views, func(v api.PoolView) string { return v.Name }, limit, s.ReplyBudget(), "pool")
}

// poolDelete has the writer record that the pool is deleted and remove its
// secrets; the reconciler retires every proxy of the pool (deletes need no
// secrets). Deleting a deleted pool appends nothing and removes secrets a
// crash left behind.
func (s *Server) poolDelete(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.NameRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	if aerr := checkIdentifier("name", req.Name); aerr != nil {
		return nil, aerr
	}
	return s.b.DeletePool(ctx, req.Name)
}
