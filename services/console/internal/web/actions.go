package web

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/services/console/internal/access"
	"proxyfleet/services/console/internal/fleetview"
)

// maxForm bounds a form's body.
const maxForm = 16 << 10

// actionTimeout bounds one API call of an action.
const actionTimeout = api.DefaultTimeout

type confirmBody struct {
	Title, What, Action, Button, Back string
	Fields                            []kv
	Danger, AskReason                 bool
	MaxReason                         int
}

// forbid answers 403 with a sentence.
func (s *Server) forbid(w http.ResponseWriter, r *http.Request, ss *access.Session, kind, text string) {
	s.m.actions.Add(r.Context(), 1, metric.WithAttributes(attribute.String("action", kind), attribute.String("outcome", "forbidden")))
	s.message(w, r, ss, http.StatusForbidden, "Refused", text, "/")
}

// crossSite reports whether the browser says the request comes from
// another site (Sec-Fetch-Site, or an Origin naming another host).
func crossSite(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "cross-site", "same-site":
		return true
	}
	if o := r.Header.Get("Origin"); o != "" && o != "null" {
		u, err := url.Parse(o)
		if err != nil || u.Host != r.Host {
			return true
		}
	}
	return false
}

// action serves one action: the session must be an operator's and carry
// its CSRF token; without confirm=yes the answer is a page asking to
// confirm; with it the action is done through the API and the browser is
// sent back to the pool page (303).
func (s *Server) action(kind string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, maxForm)
		ss := s.session(w, r)
		if ss == nil {
			s.forbid(w, r, nil, kind, "Sign in first: actions need an operator's session.")
			return
		}
		if err := r.ParseForm(); err != nil {
			s.message(w, r, ss, http.StatusBadRequest, "Bad request", "The form does not read.", "/")
			return
		}
		if !ss.Role.CanAct() {
			s.forbid(w, r, ss, kind, "Your role, "+string(ss.Role)+", may look but not act: ask for an operator's account.")
			return
		}
		if crossSite(r) || !ss.CheckCSRF(r.PostForm.Get("csrf")) {
			s.forbid(w, r, ss, kind, "The CSRF token of this form is missing or wrong: reload the page and try again.")
			return
		}
		name, id := r.PathValue("name"), r.PathValue("id")
		back := "/pools/" + name
		if fe := events.CheckIdentifier("pool", name); fe != nil {
			s.message(w, r, ss, http.StatusBadRequest, "Bad request", fe.Error(), "/")
			return
		}
		if id != "" {
			if fe := events.CheckIdentifier("proxy", id); fe != nil {
				s.message(w, r, ss, http.StatusBadRequest, "Bad request", fe.Error(), back)
				return
			}
			if p, ok := s.cfg.Store.Proxy(id); ok && p.Pool != name {
				s.message(w, r, ss, http.StatusBadRequest, "Bad request", "Proxy "+id+" is of pool "+p.Pool+", not "+name+".", "/pools/"+p.Pool)
				return
			}
		}
		c := confirmBody{Action: r.URL.Path, Back: back, MaxReason: api.MaxBanReason}
		var do func(ctx context.Context) error
		switch kind {
		case "scale":
			n, err := strconv.Atoi(strings.TrimSpace(r.PostForm.Get("replicas")))
			if err != nil || n < 0 || n > events.MaxPoolSize {
				s.message(w, r, ss, http.StatusBadRequest, "Bad request", "replicas: want a number of proxies from 0 to "+strconv.Itoa(events.MaxPoolSize)+".", back)
				return
			}
			c.Title = "Scale pool " + name
			c.What = "Pool " + name + " will want " + strconv.Itoa(n) + " proxies: the planner requests or retires proxies until it has them."
			c.Button = "Scale " + name + " to " + strconv.Itoa(n)
			c.Fields = []kv{{"replicas", strconv.Itoa(n)}}
			do = func(ctx context.Context) error { return s.scale(ctx, name, n) }
		case "delete":
			c.Title = "Delete pool " + name
			c.What = "Pool " + name + " will be deleted: the planner retires every proxy of it and deletes their instances. This cannot be undone; applying the pool again makes new proxies."
			c.Button, c.Danger = "Delete "+name, true
			do = func(ctx context.Context) error { _, err := s.cfg.API.PoolDelete(ctx, name); return err }
		case "recycle":
			c.Title = "Recycle proxy " + id
			c.What = "A replacement of proxy " + id + " is requested first; " + id + " is retired once the replacement is ready."
			c.Button = "Recycle " + id
			do = func(ctx context.Context) error {
				_, err := s.cfg.API.Recycle(ctx, api.ProxyRecycleRequest{ID: id})
				return err
			}
		case "ban":
			reason := strings.TrimSpace(r.PostForm.Get("reason"))
			if len(reason) > api.MaxBanReason {
				s.message(w, r, ss, http.StatusBadRequest, "Bad request", "reason: at most "+strconv.Itoa(api.MaxBanReason)+" bytes.", back)
				return
			}
			c.Title = "Report a ban of proxy " + id
			c.What = "Proxy " + id + "'s egress is reported banned: the planner replaces it as the pool's rules say."
			c.Button, c.AskReason, c.Danger = "Report "+id+" banned", true, true
			do = func(ctx context.Context) error {
				_, err := s.cfg.API.ReportBan(ctx, api.ProxyBanRequest{ID: id, Reason: reason})
				return err
			}
		}
		if r.PostForm.Get("confirm") != "yes" {
			s.render(w, r, "confirm", http.StatusOK, time.Now(), s.newView(ss, c.Title, "fleet", c))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), actionTimeout)
		defer cancel()
		if err := do(ctx); err != nil {
			status, text := http.StatusBadGateway, "The planner did not do it: "+err.Error()
			var aerr *api.APIError
			if errors.As(err, &aerr) {
				text = "The planner refused or failed: " + aerr.Message
				if n, convErr := strconv.Atoi(aerr.Status); convErr == nil && n >= 400 && n < 600 {
					status = n
				}
			}
			var pe *pageError
			if errors.As(err, &pe) {
				status, text = pe.status, pe.text
			}
			s.m.actions.Add(r.Context(), 1, metric.WithAttributes(attribute.String("action", kind), attribute.String("outcome", "failed")))
			s.cfg.Log.Warn("an action failed", "action", kind, "pool", name, "proxy", id, "user", ss.User, "err", err)
			s.message(w, r, ss, status, c.Title+": not done", text, back)
			return
		}
		s.m.actions.Add(r.Context(), 1, metric.WithAttributes(attribute.String("action", kind), attribute.String("outcome", "done")))
		s.cfg.Log.Info("action done", "action", kind, "pool", name, "proxy", id, "user", ss.User)
		http.Redirect(w, r, back, http.StatusSeeOther)
	}
}

// scale applies pool name's spec with size n. The spec comes from the
// planner (pool.get), public: a pool with secrets is refused, since the
// apply would drop them.
func (s *Server) scale(ctx context.Context, name string, n int) error {
	sum, ok := s.cfg.Store.Pool(name, time.Now())
	if !ok || sum.Pool == nil {
		return &pageError{status: http.StatusConflict, text: "The console's view holds no pool " + name + " (deleted, or not projected yet): it cannot tell whether the pool has secrets, so it does not scale it."}
	}
	if note := scaleNote(sum.Pool); note != "" {
		return &pageError{status: http.StatusConflict, text: note}
	}
	pv, err := s.cfg.API.PoolGet(ctx, name)
	if err != nil {
		return err
	}
	if pv.Deleted {
		return &pageError{status: http.StatusConflict, text: "Pool " + name + " is deleted: apply it again through the API."}
	}
	spec := pv.Spec
	if spec.Auth != nil || spec.Provider == events.ProviderExternal || spec.Autoscale != nil {
		return &pageError{status: http.StatusConflict, text: "Pool " + name + " changed meanwhile: " + scaleNote(&fleetview.Pool{Provider: spec.Provider, Spec: spec})}
	}
	spec.Size = n
	_, err = s.cfg.API.PoolApply(ctx, spec)
	return err
}
