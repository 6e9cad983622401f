package planner

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// External pools: proxies proxyfleet does not create (see
// [decide.ReconcileExternal]). The planner records each listed proxy as
// requested and then, speaking as the agent of entry and target
// "external" (its observations on that agent's subjects), running at its
// address; an unlisted one as retiring and then deleted. No command is
// ever sent. Their credentials live in fleet-secrets
// ([events.PoolSecrets.External]) and reach health and the gateway sealed
// ([events.ProbeSecret.External]); the log carries the URLs without them.

// Resolver resolves the hostnames of external proxies at apply;
// *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// externalObserver is the external agent's store: the observations the
// planner appends for external proxies, on that agent's subjects.
func (p *Planner) externalObserver() *bus.EventStore {
	return bus.NewEventStore(p.conn, events.AgentSource(events.ProviderExternal, events.ProviderExternal), p.log)
}

// reconcileExternal decides what external pool ps needs
// ([decide.ReconcileExternal]), has it written, records the pool's
// conditions and returns when to look at it again.
func (rc *reconciler) reconcileExternal(ctx context.Context, r *round, ps poolSnap, f *flight) decide.When {
	pool := ps.pool
	pctx := rc.poolCtx(ctx, pool)
	in := &decide.Input{Now: r.now, AgeNow: rc.ageNow(), Config: rc.rules, Pool: pool.Pool, Members: ps.members, Health: r.health}
	plan := decide.ReconcileExternal(in)
	for _, d := range plan.Decisions {
		if pctx.Err() != nil {
			break
		}
		x := r.byID[d.Proxy.ID]
		switch d.Kind {
		case decide.List:
			rc.listExternal(pctx, f, pool, d.Listed)
		case decide.Run:
			rc.observeExternal(pctx, x.ID, x.Pool, events.ProxyRunning, 1, events.ProxyRunningData{Address: d.Listed.Address, Attempt: 1}, x.LastSeq)
		case decide.Unlist:
			rc.unlistExternal(pctx, f, x, d.Reason)
		case decide.Forget:
			rc.observeExternal(pctx, x.ID, x.Pool, events.ProxyDeleted, max(x.DeleteAttempt, 1), events.ProxyDeletedData{Attempt: max(x.DeleteAttempt, 1)}, x.LastSeq)
		case decide.Disable:
			rc.disableExternal(pctx, f, x, d.Until, d.Reason)
		case decide.Retire:
			rc.retire(pctx, r, f, x, d.Reason, "", false)
		case decide.Redelete:
			rc.reissueDelete(pctx, f, x)
		case decide.Abandon:
			ab := events.ProxyAbandonedData{Reason: d.Reason}
			rc.decide(pctx, f, x, events.ProxyAbandoned, decisionID(x.ID, events.ProxyAbandoned, x.LastSeq, ab), ab, nil)
		}
	}
	if !pool.Deleted && ctx.Err() == nil {
		cooling := rc.cooling(ctx, plan.Found.Usable, r.now)
		cs := decide.ExternalConditions(&plan.Found, cooling, rc.fileErrs[pool.Name])
		rc.updateConditions(pctx, f, pool, decide.Changed(&pool.Pool, cs))
	}
	return decide.ExternalTimer(rc.rules, &pool.Pool, ps.members, len(plan.Decisions) > 0, rc.ageNow())
}

// listExternal records listed proxy l of pool: requested on entry and
// target external, with l's port and labels, then running at l's address
// as the external agent. A crash in between leaves a requested proxy the
// next round gives its running ([decide.Run]).
func (rc *reconciler) listExternal(ctx context.Context, f *flight, pool Pool, l decide.Listed) {
	a := decide.Target{Entry: events.ProviderExternal, Target: events.ProviderExternal, Labels: l.Labels}
	req := newRequest(pool, a, "", "")
	req.data.Port = l.Port
	req.data.Egress = nil
	ctx, span := rc.startRequest(ctx, req)
	f.decide(ctx, span, pool.Name, events.AggregateProxy, req.id, &bus.Expect{Seq: 0},
		[]bus.Decision{{Type: events.ProxyRequested, MsgID: req.msgID, Data: req.data}},
		append(req.logArgs(), "address", l.Address),
		func(ctx context.Context, seq uint64) {
			rc.observeExternal(ctx, req.id, pool.Name, events.ProxyRunning, 1, events.ProxyRunningData{Address: l.Address, Attempt: 1}, seq)
		})
}

// unlistExternal retires x for reason and then, as the external agent,
// records it deleted: nothing is deleted anywhere. A crash in between
// leaves a retiring proxy the next round forgets ([decide.Forget]).
func (rc *reconciler) unlistExternal(ctx context.Context, f *flight, x Proxy, reason string) {
	d := events.ProxyRetiringData{Reason: reason}
	rc.decide(ctx, f, x, events.ProxyRetiring, decisionID(x.ID, events.ProxyRetiring, x.LastSeq, d), d, func(ctx context.Context, seq uint64) {
		rc.observeExternal(ctx, x.ID, x.Pool, events.ProxyDeleted, x.DeleteAttempt+1, events.ProxyDeletedData{Attempt: x.DeleteAttempt + 1}, seq)
	})
}

// forgetExternal ends external proxy x whatever its state: retiring and
// deleted (as the external agent), or deleted alone when it retires
// already. An owned pool's rules call it for a member left from when the
// pool was external.
func (rc *reconciler) forgetExternal(ctx context.Context, f *flight, x Proxy, reason string) {
	switch x.State {
	case events.ProxyRetiring:
		rc.observeExternal(ctx, x.ID, x.Pool, events.ProxyDeleted, max(x.DeleteAttempt, 1), events.ProxyDeletedData{Attempt: max(x.DeleteAttempt, 1)}, x.LastSeq)
	default:
		if reason == "" {
			reason = "the pool is no longer external"
		}
		rc.unlistExternal(ctx, f, x, reason)
	}
}

// disableExternal appends the decision that x is out of service until
// until, for reason.
func (rc *reconciler) disableExternal(ctx context.Context, f *flight, x Proxy, until time.Time, reason string) *unit {
	d := events.ProxyDisabledData{Until: until.UTC(), Reason: reason}
	return rc.decide(ctx, f, x, events.ProxyDisabled, decisionID(x.ID, events.ProxyDisabled, x.LastSeq, d), d, nil)
}

// observeExternal appends, as the external agent, the observation typ of
// proxy id expecting its last sequence seq. Its id is the agent's for
// attempt (of the create, or of the delete), so a repeat after a crash is recognised; a conflict (the proxy
// moved on) leaves it to the next round.
func (rc *reconciler) observeExternal(ctx context.Context, id, pool, typ string, attempt int, data any, seq uint64) {
	got, err := rc.extObserver.Append(ctx, events.AggregateProxy, id, typ, events.ProxyEventID(id, typ, uint64(max(attempt, 1))), data, &bus.Expect{Seq: seq})
	if err != nil {
		if ctx.Err() == nil && !errors.Is(err, bus.ErrConflict) {
			rc.log.WarnContext(ctx, "record an external proxy's observation; the next round tries again", "proxy", id, "pool", pool, "type", typ, "err", err)
		}
		return
	}
	rc.noteOwn(got)
	rc.log.InfoContext(ctx, "observed as the external agent", "proxy", id, "pool", pool, "observation", typ)
}

// cooling reports which of the usable proxies a gateway keeps off some
// site now (a live entry in fleet-gateway-cooldowns, keyed
// "<proxy>.<site>"). Unreadable entries count as none: the condition is
// informative.
func (rc *reconciler) cooling(ctx context.Context, usable []decide.Proxy, now time.Time) map[string]bool {
	if rc.cooldowns == nil || len(usable) == 0 {
		return nil
	}
	filters := make([]string, len(usable))
	for i, x := range usable {
		filters[i] = x.ID + ".*"
	}
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	keys, err := rc.cooldowns.ListKeysFiltered(lctx, filters...)
	if err != nil {
		return nil
	}
	out := map[string]bool{}
	for k := range keys.Keys() {
		id, _, _ := strings.Cut(k, ".")
		if out[id] {
			continue
		}
		e, err := rc.cooldowns.Get(lctx, k)
		if err != nil {
			continue
		}
		var v events.GatewayCooldown
		if json.Unmarshal(e.Value(), &v) != nil {
			continue
		}
		until := v.Until
		if limit := v.At.Add(events.MaxBanCooldown); until.After(limit) {
			until = limit
		}
		if until.After(now) {
			out[id] = true
		}
	}
	return out
}

// expandExternal completes an external pool's spec at apply: the proxies
// of its file, when it names one (each checked, a bad line refused with
// its number), and each upstream address checked against the egress
// policy's refused ranges (hostnames resolved; --external-allow-cidrs
// opens ranges). Its errors name the field and never a credential.
func (p *Planner) expandExternal(ctx context.Context, spec *events.PoolSpec) *api.APIError {
	x := spec.External
	if spec.Provider != events.ProviderExternal || x == nil {
		return nil
	}
	var lines []int
	if x.File != "" {
		proxies, at, err := readExternalFile(x.File)
		if err != nil {
			return api.Invalid([]events.FieldError{{Field: "external.file", Reason: err.Error(), Value: x.File}})
		}
		x.Proxies, lines = proxies, at
		if spec.Size != 0 && spec.Size != len(proxies) {
			return api.Invalid([]events.FieldError{{Field: "size",
				Reason: fmt.Sprintf("of an external pool is the number of its proxies (%d in its file): leave it 0 or give that", len(proxies)), Value: fmt.Sprint(spec.Size)}})
		}
		spec.Size = len(proxies)
	}
	var fields []events.FieldError
	for i, px := range x.Proxies {
		up, err := events.ParseUpstream(px.URL)
		if err != nil {
			continue // the spec's validation reports it
		}
		if why := p.checkUpstream(ctx, up.Address); why != "" {
			fe := events.FieldError{Field: fmt.Sprintf("external.proxies[%d].url", i), Reason: why, Value: "http://" + up.Address}
			if lines != nil {
				fe = events.FieldError{Field: "external.file", Reason: fmt.Sprintf("line %d: %s", lines[i], why), Value: x.File}
			}
			fields = append(fields, fe)
		}
	}
	if len(fields) > 0 {
		return api.Invalid(fields)
	}
	return nil
}

// checkUpstream returns why the egress policy refuses an external proxy
// at address ("host:port"), "" when it does not. A hostname is resolved
// and every address it resolves to checked; no address is dialled.
func (p *Planner) checkUpstream(ctx context.Context, address string) string {
	host, _, _ := net.SplitHostPort(address)
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		got, err := p.cfg.Resolver.LookupNetIP(rctx, "ip", host)
		if err != nil || len(got) == 0 {
			return fmt.Sprintf("host %s does not resolve; list a resolvable host or an address", host)
		}
		addrs = got
	}
	for _, a := range addrs {
		if rule := decide.CheckUpstream(a, p.cfg.ExternalAllowCIDRs); rule != "" {
			what := host + " is in a range"
			if a.String() != host {
				what = host + " resolves to " + a.String() + ", in a range"
			}
			return fmt.Sprintf("%s the egress policy refuses (%s); the planner's --external-allow-cidrs may open such a range", what, rule)
		}
	}
	return ""
}

// maxExternalFile bounds an external pool's file.
const maxExternalFile = 4 << 20

// readExternalFile reads an external pool's file ([events.External]): one
// proxy per line, "<url> [key=value,...]", blank lines and lines starting
// with '#' skipped. It returns the proxies and the line of each; its
// error names the line and never quotes a credential.
func readExternalFile(path string) ([]events.ExternalProxy, []int, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, nil, fmt.Errorf("cannot be read (%v); the planner's host must hold it", err)
	}
	if len(raw) > maxExternalFile {
		return nil, nil, fmt.Errorf("is larger than %d bytes", maxExternalFile)
	}
	return parseExternalFile(raw)
}

// parseExternalFile parses the text of an external pool's file.
func parseExternalFile(raw []byte) ([]events.ExternalProxy, []int, error) {
	var out []events.ExternalProxy
	var lines []int
	seen := map[string]int{}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 0, 64<<10), maxExternalFile)
	n := 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) > 2 {
			return nil, nil, fmt.Errorf("line %d: want \"<url> [key=value,...]\" (more than two fields)", n)
		}
		up, err := events.ParseUpstream(fields[0])
		if err != nil {
			return nil, nil, fmt.Errorf("line %d: the URL %s", n, err)
		}
		if at, ok := seen[up.Address]; ok {
			return nil, nil, fmt.Errorf("line %d: lists %s again (line %d)", n, up.Address, at)
		}
		seen[up.Address] = n
		px := events.ExternalProxy{URL: fields[0]}
		if len(fields) == 2 {
			px.Labels = map[string]string{}
			for kv := range strings.SplitSeq(fields[1], ",") {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, nil, fmt.Errorf("line %d: labels must be key=value,... (%q is not)", n, kv)
				}
				px.Labels[k] = v
			}
			var v events.ValidationError
			if events.CheckLabels(&v, "labels", px.Labels); v.Err() != nil {
				return nil, nil, fmt.Errorf("line %d: %v", n, v.Err())
			}
		}
		out = append(out, px)
		lines = append(lines, n)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("line %d: %v", n+1, err)
	}
	if len(out) == 0 {
		return nil, nil, errors.New("lists no proxy")
	}
	if len(out) > events.MaxExternalProxies {
		return nil, nil, fmt.Errorf("lists %d proxies, more than %d", len(out), events.MaxExternalProxies)
	}
	return out, lines, nil
}

// watchFiles reads the file of every external pool that names one, on the
// leader: a changed list becomes a new revision of the pool (its secrets
// written before the applied event, as pool.apply does); a file that does
// not read, or lists a refused address, leaves the list as it was and
// turns the pool's Placed condition False (ExternalFileInvalid, naming
// the line).
func (rc *reconciler) watchFiles(ctx context.Context) {
	type filePool struct {
		name string
		spec events.PoolSpec
	}
	var pools []filePool
	rc.mu.Lock()
	for _, pl := range rc.st.pools {
		if !pl.Deleted && pl.Revision > 0 && pl.Spec.External != nil && pl.Spec.External.File != "" {
			pools = append(pools, filePool{name: pl.Name, spec: pl.Spec})
		}
	}
	rc.mu.Unlock()
	for name := range rc.fileErrs {
		if !slices.ContainsFunc(pools, func(fp filePool) bool { return fp.name == name }) {
			delete(rc.fileErrs, name)
		}
	}
	for _, fp := range pools {
		if ctx.Err() != nil {
			return
		}
		spec := fp.spec
		spec.Gateway, spec.Egress = spec.Gateway.Clone(), spec.Egress.Clone()
		spec.External = &events.External{File: fp.spec.External.File, DisableFor: fp.spec.External.DisableFor}
		spec.Size = 0
		msg := ""
		if _, aerr := (backend{rc.Planner}).ApplyPool(ctx, spec); aerr != nil {
			msg = aerr.Message
			if len(aerr.Fields) > 0 {
				msg = aerr.Fields[0].Reason
			}
		}
		if msg != rc.fileErrs[fp.name] {
			if msg == "" {
				delete(rc.fileErrs, fp.name)
				rc.log.Info("the external pool's file reads again", "pool", fp.name)
			} else {
				rc.fileErrs[fp.name] = msg
				rc.log.Warn("the external pool's file is not applied; its list stays as it was", "pool", fp.name, "file", fp.spec.External.File, "problem", msg)
			}
			t := rc.timers[fp.name]
			t.Retry = true
			rc.timers[fp.name] = t
		}
	}
}

// externalOf reports whether the proxy is an external pool's.
func externalOf(x Proxy) bool { return x.Entry == events.ProviderExternal }

// errExternalNotReplaced refuses what would delete or replace an external
// proxy.
func errExternalNotReplaced(id string) *api.APIError {
	return api.Invalid([]events.FieldError{{Field: "id", Value: id,
		Reason: "is an external proxy: proxyfleet neither creates nor deletes it, so nothing can retire or replace it; remove it from its pool's list (external.proxies or external.file) to stop using it, or report a ban (proxy.report-ban) to disable it for the pool's disableFor"}})
}

// disableBanned is report-ban for an external proxy: on the leader, it
// appends disabled for the pool's disableFor with the report's reason; a
// ban while disabled extends it. A proxy being recorded or forgotten is
// left alone.
func (b backend) disableBanned(ctx context.Context, id, reason string) (events.ProxyView, *api.APIError) {
	for range maxConflictRetries {
		var u *unit
		var lerr *api.APIError
		if aerr := b.asLeader(ctx, func(ctx context.Context, rc *reconciler, f *flight) {
			var x Proxy
			if x, lerr = b.lookupProxy(ctx, id); lerr != nil || !decide.CanDisable(x.Proxy) {
				return
			}
			pool, ok := b.poolCopy(x.Pool)
			if !ok {
				return
			}
			d := decide.DisableBan(&pool.Pool, x.Proxy, reason, rc.now())
			u = rc.disableExternal(ctx, f, x, d.Until, d.Reason)
		}); aerr != nil {
			return events.ProxyView{}, aerr
		}
		if lerr != nil {
			return events.ProxyView{}, lerr
		}
		if u != nil {
			if errors.Is(u.err, bus.ErrConflict) {
				if err := b.catchUp(ctx, events.AggregateProxy, id); err != nil {
					return events.ProxyView{}, api.Internal("could not re-read the proxy after a concurrent change; retry")
				}
				continue
			}
			if u.err != nil {
				b.log.ErrorContext(ctx, "disable an external proxy", "proxy", id, "err", u.err)
				return events.ProxyView{}, api.Internal("could not record the decision; retry")
			}
			b.log.InfoContext(ctx, "external proxy disabled on a reported ban", "proxy", id, "reason", reason)
			if err := b.waitSeq(ctx, u.seq); err != nil {
				return events.ProxyView{}, api.Internal("decision recorded but not yet visible; get the proxy again")
			}
		}
		return b.Proxy(ctx, id)
	}
	return events.ProxyView{}, errProxyConflict()
}

// openCooldowns opens fleet-gateway-cooldowns for the external pools'
// conditions; without it they count no cooling proxy.
func (p *Planner) openCooldowns(ctx context.Context) jetstream.KeyValue {
	kv, err := p.conn.JS.KeyValue(ctx, bus.BucketGatewayCooldowns)
	if err != nil {
		p.log.Warn("bucket "+bus.BucketGatewayCooldowns+" cannot be read; external pools' conditions count no cooling proxy", "err", err)
		return nil
	}
	return kv
}
