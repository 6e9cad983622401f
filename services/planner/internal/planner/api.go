package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
)

// ServiceName is the micro service every planner replica serves.
const ServiceName = "fleet-planner"

// requestTimeout bounds the work behind one API request.
const requestTimeout = 30 * time.Second

// maxConflictRetries bounds how often one request re-reads and re-decides.
const maxConflictRetries = 5

// badRequest refuses a request that cannot be read. field is the path of
// the offending value ("auth.username", "targets[1]"), or "" for the body
// as a whole; the message starts with it.
func badRequest(field, msg string) *api.APIError {
	if field == "" {
		field = bodyPath
	}
	return &api.APIError{Status: "400", Code: api.CodeBadRequest, Message: field + ": " + msg,
		Fields: []events.FieldError{{Field: field, Reason: msg}}}
}

func invalid(fields []events.FieldError) *api.APIError {
	parts := make([]string, len(fields))
	for i := range fields {
		parts[i] = fields[i].Error()
	}
	return &api.APIError{Status: "422", Code: api.CodeInvalid, Message: strings.Join(parts, "; "), Fields: fields}
}

func notFound(field, what, value string) *api.APIError {
	return &api.APIError{Status: "422", Code: api.CodeNotFound, Message: field + ": " + what + " " + strconv.Quote(value),
		Fields: []events.FieldError{{Field: field, Reason: what, Value: value}}}
}

func internal(msg string) *api.APIError {
	return &api.APIError{Status: "500", Code: api.CodeInternal, Message: msg}
}

type handlerFunc func(ctx context.Context, body []byte) (any, *api.APIError)

// startAPI adds this replica's instance of the fleet-planner micro
// service: every endpoint but those only the leader serves (see
// writer.go).
func (p *Planner) startAPI() (micro.Service, error) {
	return p.addService(func(noun, verb string) bool { return !decidingEndpoints[noun+"."+verb] }, "replica")
}

// addService adds an instance of the fleet-planner micro service with the
// endpoints serve selects; role says which in its metadata.
func (p *Planner) addService(serve func(noun, verb string) bool, role string) (micro.Service, error) {
	svc, err := micro.AddService(p.conn.NC, micro.Config{
		Name:        ServiceName,
		Version:     buildinfo.Version,
		Description: "proxyfleet planner: pool and proxy intent",
		Metadata:    map[string]string{"replica": p.cfg.ID, "role": role},
	})
	if err != nil {
		return nil, err
	}
	endpoints := []struct {
		noun, verb string
		fn         handlerFunc
	}{
		{api.NounPool, api.VerbApply, p.poolApply},
		{api.NounPool, api.VerbGet, p.poolGet},
		{api.NounPool, api.VerbList, p.poolList},
		{api.NounPool, api.VerbDelete, p.poolDelete},
		{api.NounProxy, api.VerbGet, p.proxyGet},
		{api.NounProxy, api.VerbList, p.proxyList},
		{api.NounProxy, api.VerbDelete, p.proxyDelete},
		{api.NounProxy, api.VerbRecycle, p.proxyRecycle},
		{api.NounProxy, api.VerbReportBan, p.proxyReportBan},
		{api.NounInstance, api.VerbDelete, p.instanceDelete},
	}
	groups := map[string]micro.Group{}
	for _, e := range endpoints {
		if !serve(e.noun, e.verb) {
			continue
		}
		g := groups[e.noun]
		if g == nil {
			g = svc.AddGroup(events.APIGroup(e.noun))
			groups[e.noun] = g
		}
		// Endpoint names are "<noun>-<verb>", unique in the service, so
		// nats micro info tells pool.get from proxy.get.
		if err := g.AddEndpoint(e.noun+"-"+e.verb, p.handler(e.noun+"."+e.verb, e.fn), micro.WithEndpointSubject(e.verb)); err != nil {
			_ = svc.Stop()
			return nil, fmt.Errorf("endpoint %s: %w", events.APISubject(e.noun, e.verb), err)
		}
	}
	return svc, nil
}

// handler runs fn in the trace the request carries (a trace of its own
// when it carries none), writes its reply and counts it. A refusal of the
// request (4xx) is the API working: only a 5xx marks the span failed.
func (p *Planner) handler(name string, fn handlerFunc) micro.Handler {
	endpoint := metric.WithAttributes(attribute.String("endpoint", name))
	return micro.HandlerFunc(func(req micro.Request) {
		start := time.Now()
		ctx := telemetry.Extract(context.Background(), nats.Header(req.Headers()))
		ctx, span := p.tracer.Start(ctx, "planner.api."+name, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(telemetry.MessagingAttrs("process", req.Subject(), "")...),
			trace.WithAttributes(attribute.String("rpc.system", "nats-micro"), attribute.String("rpc.method", name)))
		defer span.End()
		code := "ok"
		defer func() {
			span.SetAttributes(attribute.String("proxyfleet.api.code", code))
			p.m.apiRequests.Add(ctx, 1, endpoint, metric.WithAttributes(attribute.String("code", code)))
			p.m.apiDuration.Record(ctx, time.Since(start).Seconds(), endpoint)
		}()
		ctx, cancel := context.WithTimeout(ctx, requestTimeout)
		defer cancel()
		out, aerr := fn(ctx, req.Data())
		var body []byte
		if aerr == nil {
			body, aerr = p.replyBody(out)
		}
		if aerr != nil {
			code = aerr.Status
			level := p.log.InfoContext
			if strings.HasPrefix(aerr.Status, "5") {
				span.SetStatus(codes.Error, aerr.Code+": "+aerr.Message)
			}
			if aerr.Status == "500" {
				level = p.log.ErrorContext
			}
			level(ctx, "request refused", "endpoint", name, "code", aerr.Status, "error", aerr.Message)
			if err := req.Error(aerr.Status, aerr.Message, api.ErrorBody(aerr)); err != nil {
				p.log.Warn("reply", "endpoint", name, "err", err)
			}
			return
		}
		if err := req.Respond(body); err != nil {
			p.log.Warn("reply", "endpoint", name, "err", err)
		}
	})
}

// replyBody encodes a reply and refuses one over [Planner.replyBudget]: the
// server would drop it and the client would wait for nothing. List replies
// are built to fit (see paging.go); this catches any other.
func (p *Planner) replyBody(out any) ([]byte, *api.APIError) {
	body, ok := out.(json.RawMessage)
	if !ok {
		var err error
		if body, err = json.Marshal(out); err != nil {
			return nil, internal("could not encode the reply; retry")
		}
	}
	if budget := p.replyBudget(); len(body) > budget {
		return nil, internal(fmt.Sprintf("the reply (%d bytes) does not fit under the server's max payload (%d bytes)", len(body), budget))
	}
	return body, nil
}

// poolApply accepts a pool spec: it validates it, writes its secrets to
// fleet-secrets and appends pool applied with the next revision. An
// unchanged spec appends nothing.
func (p *Planner) poolApply(ctx context.Context, body []byte) (any, *api.APIError) {
	var spec events.PoolSpec
	present, aerr := decodeStrictPresent(body, &spec, false)
	if aerr != nil {
		return nil, aerr
	}
	var required []events.FieldError
	if !present["size"] {
		// encoding/json would leave it 0: a re-apply that forgot the size
		// must not empty the pool.
		required = append(required, events.FieldError{Field: "size", Reason: "is required (send 0 to empty the pool)"})
	}
	spec.Normalize()
	if aerr := p.validateSpec(ctx, &spec, required...); aerr != nil {
		return nil, aerr
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("pool", spec.Name))
	pub, sec := spec.Public(), spec.Secrets()
	digest := sec.Digest(p.digestKey)
	pubJSON, _ := json.Marshal(pub)
	for range maxConflictRetries {
		p.mu.Lock()
		var cur Pool
		cp := p.st.pools[spec.Name]
		if cp != nil {
			cur = *cp
		}
		p.mu.Unlock()
		if cp != nil && !cur.Deleted && cur.Revision > 0 && sec.Matches(p.digestKey, cur.SecretsDigest) {
			curJSON, _ := json.Marshal(cur.Spec)
			if bytes.Equal(curJSON, pubJSON) {
				if aerr := p.ensureSecrets(ctx, spec.Name, cur.Revision, sec); aerr != nil {
					return nil, aerr
				}
				p.creds.probeCredNow(ctx, spec.Name)
				return p.poolView(spec.Name), nil
			}
		}
		rev := cur.Revision + 1
		sec.Revision = rev
		raw, _ := json.Marshal(sec)
		if _, err := p.secrets.Put(ctx, spec.Name, raw); err != nil {
			return nil, internal("could not store the pool's secrets; nothing was applied, retry")
		}
		data := events.PoolAppliedData{Spec: pub, Revision: rev, SecretsDigest: digest}
		seq, err := p.appendIntent(ctx, spec.Name, events.PoolApplied, decisionID(spec.Name, events.PoolApplied, uint64(rev), data), data, cur.LastSeq,
			[]any{"pool", spec.Name, "decision", events.PoolApplied, "revision", rev})
		if errors.Is(err, bus.ErrConflict) {
			if err := p.catchUp(ctx, events.AggregatePool, spec.Name); err != nil {
				return nil, internal("could not re-read the pool after a concurrent change; retry")
			}
			continue
		}
		if err != nil {
			p.log.ErrorContext(ctx, "append pool applied", "pool", spec.Name, "err", err)
			return nil, internal("could not record the pool; retry")
		}
		p.log.InfoContext(ctx, "pool applied", "pool", spec.Name, "revision", rev, "size", spec.Size, "entry", spec.Provider)
		if err := p.waitSeq(ctx, seq); err != nil {
			return nil, internal("pool recorded but not yet visible; get it again")
		}
		p.creds.probeCredNow(ctx, spec.Name)
		return p.poolView(spec.Name), nil
	}
	return nil, &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the pool keeps changing concurrently; retry"}
}

// ensureSecrets rewrites the secrets of an unchanged re-apply when the
// stored ones do not match (a write that raced or a lost bucket), so a
// re-apply always repairs them.
func (p *Planner) ensureSecrets(ctx context.Context, pool string, rev int, sec events.PoolSecrets) *api.APIError {
	e, err := p.secrets.Get(ctx, pool)
	if err == nil {
		var have events.PoolSecrets
		if json.Unmarshal(e.Value(), &have) == nil && have.Digest(p.digestKey) == sec.Digest(p.digestKey) {
			return nil
		}
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		return internal("could not read the pool's secrets; retry")
	}
	sec.Revision = rev
	raw, _ := json.Marshal(sec)
	if _, err := p.secrets.Put(ctx, pool, raw); err != nil {
		return internal("could not store the pool's secrets; retry")
	}
	return nil
}

// validateSpec checks the spec's fields, then that its provider entry and
// targets are known to the fleet. required lists the problems the decode
// found (fields left out); they are reported with the others.
func (p *Planner) validateSpec(ctx context.Context, spec *events.PoolSpec, required ...events.FieldError) *api.APIError {
	fields := append([]events.FieldError(nil), required...)
	var ve *events.ValidationError
	if err := spec.Validate(); errors.As(err, &ve) {
		fields = append(fields, ve.Fields...)
	} else if err != nil {
		fields = append(fields, events.FieldError{Field: "(body)", Reason: err.Error()})
	}
	bad := map[string]bool{}
	for _, f := range fields {
		bad[f.Field] = true
	}
	if !bad["provider"] {
		p.mu.Lock()
		targets, known := p.knownTargetsLocked(spec.Provider)
		p.mu.Unlock()
		stale := !known
		for _, t := range spec.Targets {
			stale = stale || !targets[t]
		}
		if stale {
			p.refreshAgents(ctx, spec.Provider)
		}
		p.mu.Lock()
		targets, known = p.knownTargetsLocked(spec.Provider)
		entries := p.knownEntriesLocked()
		p.mu.Unlock()
		if !known {
			reason := "unknown provider entry; no agent announced it"
			if len(entries) > 0 {
				reason += " (known: " + strings.Join(entries, ", ") + ")"
			}
			fields = append(fields, events.FieldError{Field: "provider", Reason: reason, Value: spec.Provider})
		} else {
			for i, t := range spec.Targets {
				f := fmt.Sprintf("targets[%d]", i)
				if !bad[f] && !targets[t] {
					fields = append(fields, events.FieldError{Field: f,
						Reason: "not a target of entry " + spec.Provider + " (known: " + strings.Join(slices.Sorted(maps.Keys(targets)), ", ") + ")", Value: t})
				}
			}
		}
	}
	if len(fields) > 0 {
		return invalid(fields)
	}
	return nil
}

func (p *Planner) poolView(name string) api.PoolView {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pl := p.st.pools[name]; pl != nil {
		return pl.view()
	}
	return api.PoolView{Name: name}
}

// lookupPool returns a copy of the pool named by req, or a 422.
func (p *Planner) lookupPool(field, name string) (Pool, *api.APIError) {
	if fe := events.CheckIdentifier(field, name); fe != nil {
		return Pool{}, invalid([]events.FieldError{*fe})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.st.pools[name]
	if pl == nil || pl.Revision == 0 {
		return Pool{}, notFound(field, "unknown pool", name)
	}
	return *pl, nil
}

func (p *Planner) poolGet(_ context.Context, body []byte) (any, *api.APIError) {
	var req api.NameRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	if _, aerr := p.lookupPool("name", req.Name); aerr != nil {
		return nil, aerr
	}
	return p.poolView(req.Name), nil
}

// poolList answers one page of the pools an operator can see: applied
// ones, and deleted ones until their last proxy is gone.
func (p *Planner) poolList(_ context.Context, body []byte) (any, *api.APIError) {
	var req api.PoolListRequest
	present, aerr := decodeStrictPresent(body, &req, true)
	if aerr != nil {
		return nil, aerr
	}
	limit, fields := checkPage(req.PageRequest, present, "pool name")
	if len(fields) > 0 {
		return nil, invalid(fields)
	}
	p.mu.Lock()
	visible := func(yield func(*Pool) bool) {
		for _, pl := range p.st.pools {
			if pl.Revision == 0 || (pl.Deleted && len(pl.members) == 0) {
				continue
			}
			if !yield(pl) {
				return
			}
		}
	}
	pools := firstAfter(visible, func(pl *Pool) string { return pl.Name }, req.After, limit+1)
	views := make([]api.PoolView, len(pools))
	for i, pl := range pools {
		views[i] = pl.view()
	}
	p.mu.Unlock()
	return pageJSON("pools", views, func(v api.PoolView) string { return v.Name }, limit, p.replyBudget(), "pool")
}

// poolDelete appends pool deleted, then removes the pool's secrets from
// fleet-secrets; the reconciler retires every proxy of the pool (deletes
// need no secrets). Deleting a deleted pool appends nothing and removes
// secrets a crash left behind.
func (p *Planner) poolDelete(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.NameRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	for range maxConflictRetries {
		cur, aerr := p.lookupPool("name", req.Name)
		if aerr != nil {
			return nil, aerr
		}
		if cur.Deleted {
			// A repeat after a crash between the event and the removal.
			if aerr := p.removeSecrets(ctx, req.Name, cur.Revision); aerr != nil {
				return nil, aerr
			}
			return p.poolView(req.Name), nil
		}
		rev := cur.Revision + 1
		data := events.PoolDeletedData{Revision: rev}
		seq, err := p.appendIntent(ctx, req.Name, events.PoolDeleted, decisionID(req.Name, events.PoolDeleted, uint64(rev), data), data, cur.LastSeq,
			[]any{"pool", req.Name, "decision", events.PoolDeleted, "revision", rev})
		if errors.Is(err, bus.ErrConflict) {
			if err := p.catchUp(ctx, events.AggregatePool, req.Name); err != nil {
				return nil, internal("could not re-read the pool after a concurrent change; retry")
			}
			continue
		}
		if err != nil {
			p.log.ErrorContext(ctx, "append pool deleted", "pool", req.Name, "err", err)
			return nil, internal("could not record the deletion; retry")
		}
		p.log.InfoContext(ctx, "pool deleted", "pool", req.Name, "revision", rev)
		if aerr := p.removeSecrets(ctx, req.Name, rev); aerr != nil {
			return nil, aerr
		}
		if err := p.waitSeq(ctx, seq); err != nil {
			return nil, internal("deletion recorded but not yet visible; get the pool again")
		}
		return p.poolView(req.Name), nil
	}
	return nil, &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the pool keeps changing concurrently; retry"}
}

// lookupProxy returns a copy of the proxy with id, or a 422. A proxy that
// finished long ago is no longer in memory: it is folded from the log.
func (p *Planner) lookupProxy(ctx context.Context, id string) (Proxy, *api.APIError) {
	if fe := events.CheckIdentifier("id", id); fe != nil {
		return Proxy{}, invalid([]events.FieldError{*fe})
	}
	p.mu.Lock()
	var cp Proxy
	x := p.st.proxies[id]
	ok := x != nil
	if ok {
		cp = *x // copied under the lock: the fold writes it
	}
	p.mu.Unlock()
	if ok {
		return cp, nil
	}
	return p.recallProxy(ctx, id)
}

func (p *Planner) proxyGet(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	x, aerr := p.lookupProxy(ctx, req.ID)
	if aerr != nil {
		return nil, aerr
	}
	return x.ProxyView, nil
}

// proxyList answers one page of the live proxies (not deleted or
// abandoned), of one pool or of all, in id order.
func (p *Planner) proxyList(_ context.Context, body []byte) (any, *api.APIError) {
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
		return nil, invalid(fields)
	}
	if req.Pool != "" {
		if _, aerr := p.lookupPool("pool", req.Pool); aerr != nil {
			return nil, aerr
		}
	}
	p.mu.Lock()
	pools := p.st.pools
	if req.Pool != "" {
		pools = map[string]*Pool{req.Pool: p.st.pools[req.Pool]}
	}
	live := func(yield func(*Proxy) bool) {
		for _, pl := range pools {
			if pl == nil {
				continue
			}
			for _, x := range pl.members {
				if !yield(x) {
					return
				}
			}
		}
	}
	proxies := firstAfter(live, func(x *Proxy) string { return x.ID }, req.After, limit+1)
	views := make([]events.ProxyView, len(proxies))
	for i, x := range proxies {
		views[i] = x.ProxyView
	}
	p.mu.Unlock()
	return pageJSON("proxies", views, func(v events.ProxyView) string { return v.ID }, limit, p.replyBudget(), "proxy")
}

func (p *Planner) proxyDelete(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyDeleteRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	reason := "deleted by operator"
	if req.SkipCleanup {
		reason = "deleted by operator, cleanup skipped"
	}
	return p.retireByOperator(ctx, req.ID, reason, req.SkipCleanup, false)
}

func (p *Planner) proxyRecycle(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyRecycleRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	if req.Now {
		return p.retireByOperator(ctx, req.ID, "recycled by operator", false, false)
	}
	return p.recycle(ctx, req.ID)
}

// maxBanReason bounds the reason of a ban report.
const maxBanReason = 160

// proxyReportBan retires a proxy whose egress is banned at once, recording
// the ban in the retiring reason ("banned: <reason>"), and requests its
// replacement in the same request, so the pool does not wait a reconcile
// round. When no target can take the replacement now, the proxy is retired
// all the same and the pool's Placed condition says why it stays short.
func (p *Planner) proxyReportBan(ctx context.Context, body []byte) (any, *api.APIError) {
	var req api.ProxyBanRequest
	if aerr := decodeStrict(body, &req, false); aerr != nil {
		return nil, aerr
	}
	reason := strings.TrimSpace(req.Reason)
	if reason == "" {
		reason = "reported"
	}
	if len(reason) > maxBanReason {
		return nil, invalid([]events.FieldError{{Field: "reason", Reason: fmt.Sprintf("must be at most %d bytes", maxBanReason)}})
	}
	return p.retireByOperator(ctx, req.ID, "banned: "+reason, false, true)
}

// retireByOperator retires one proxy and sends its delete command, or, with
// skipCleanup, retires and abandons it without touching the instance; with
// replace it also requests the proxy's replacement in the same batch (a
// ban: the pool does not wait for a round; when no target can take one
// now, the proxy is retired all the same and the pool's Placed condition
// says why it stays short). The leader decides it (see writer.go); the
// reconciler replaces the proxy if its pool still wants it. Repeating the
// request changes nothing.
func (p *Planner) retireByOperator(ctx context.Context, id, reason string, skipCleanup, replace bool) (any, *api.APIError) {
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("proxy", id))
	for range maxConflictRetries {
		x, aerr := p.lookupProxy(ctx, id)
		if aerr != nil {
			return nil, aerr
		}
		if events.IsTerminal(x.State) || x.State == events.ProxyRetiring && (!skipCleanup || x.SkipCleanup) {
			return x.ProxyView, nil
		}
		var u *unit
		var lerr *api.APIError
		if aerr := p.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
			if x, lerr = p.lookupProxy(ctx, id); lerr != nil {
				return
			}
			switch {
			case events.IsTerminal(x.State):
			case x.State == events.ProxyRetiring && (!skipCleanup || x.SkipCleanup):
			case x.State == events.ProxyRetiring:
				// Already being deleted; the operator now wants it abandoned.
				ab := events.ProxyAbandonedData{Reason: reason}
				u = rc.decide(ctx, f, x, events.ProxyAbandoned, decisionID(x.ID, events.ProxyAbandoned, x.LastSeq, ab), ab, nil)
			default:
				replaced := ""
				if reasonClass(reason) == "recycled" {
					// The fill replaces it.
					replaced = reason
				}
				u = rc.retire(ctx, nil, f, x, reason, replaced, skipCleanup)
				// The replacement goes in the same batch, after the
				// retirement: the pool never holds one more proxy for it.
				if replace {
					if _, _, err := rc.requestReplacement(ctx, f, x, reason); err != nil {
						p.log.WarnContext(ctx, "no replacement for the proxy yet; retiring it anyway", "proxy", x.ID, "err", err)
					}
				}
			}
		}); aerr != nil {
			return nil, aerr
		}
		if lerr != nil {
			return nil, lerr
		}
		if u != nil {
			if errors.Is(u.err, bus.ErrConflict) {
				if err := p.catchUp(ctx, events.AggregateProxy, id); err != nil {
					return nil, internal("could not re-read the proxy after a concurrent change; retry")
				}
				continue
			}
			if u.err != nil {
				p.log.ErrorContext(ctx, "proxy decision", "proxy", id, "err", u.err)
				return nil, internal("could not record the decision; retry")
			}
			p.log.InfoContext(ctx, "proxy retired by operator", "proxy", id, "pool", x.Pool, "reason", reason)
			if err := p.waitSeq(ctx, u.seq); err != nil {
				return nil, internal("decision recorded but not yet visible; get the proxy again")
			}
		}
		x, aerr = p.lookupProxy(ctx, id)
		if aerr != nil {
			return nil, aerr
		}
		return x.ProxyView, nil
	}
	return nil, &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the proxy keeps changing concurrently; retry"}
}
