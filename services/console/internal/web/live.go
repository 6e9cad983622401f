package web

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"proxyfleet/services/console/internal/access"
)

// patch replaces the element with id ID by HTML.
type patch struct {
	ID   string `json:"id"`
	HTML string `json:"html"`
}

// liveFunc is one page's live side: key changes whenever what the page
// shows may have changed (it is cheap: generation numbers); patches
// renders the page's changing parts.
type liveFunc func(r *http.Request, v view) (key func() string, patches func(v view) ([]patch, error))

// live serves a page's Server-Sent Events: its patches at once, then
// again whenever its key changed, at most once per Coalesce, and at least
// once per Refresh (ages and rates move without changes), until the
// client goes or the server shuts down. However many changes arrive, a
// stream sends at most one patch per Coalesce, each replacing the parts
// it replaces: a page's memory does not grow with the fleet's activity.
func (s *Server) live(fn liveFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ss := s.session(w, r)
		if ss == nil {
			// 204 tells an EventSource to stop trying.
			w.WriteHeader(http.StatusNoContent)
			return
		}
		fl, ok := w.(http.Flusher)
		if !ok {
			http.Error(w, "streaming unsupported", http.StatusInternalServerError)
			return
		}
		ctx := r.Context()
		s.m.streams.Add(ctx, 1)
		defer s.m.streams.Add(ctx, -1)
		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-store")
		h.Set("X-Accel-Buffering", "no")
		w.WriteHeader(http.StatusOK)
		fmt.Fprint(w, "retry: 3000\n\n")
		v := s.liveView(ss)
		key, patches := fn(r, v)
		send := func() bool {
			ps, err := patches(s.liveView(ss))
			if err != nil {
				s.cfg.Log.Error("a live update does not render", "path", r.URL.Path, "err", err)
				return false
			}
			b, err := json.Marshal(ps)
			if err != nil {
				return false
			}
			var buf bytes.Buffer
			buf.WriteString("event: patch\ndata: ")
			buf.Write(b)
			buf.WriteString("\n\n")
			if _, err := w.Write(buf.Bytes()); err != nil {
				return false
			}
			fl.Flush()
			s.m.patches.Add(ctx, 1)
			return true
		}
		last := key()
		if !send() {
			return
		}
		tick := time.NewTicker(s.cfg.Coalesce)
		defer tick.Stop()
		sent := time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case <-s.stop:
				return
			case <-tick.C:
			}
			k := key()
			if k == last && time.Since(sent) < s.cfg.Refresh {
				continue
			}
			if !s.open() && !s.sessions.Valid(ss.ID) {
				return // signed out or expired: the page's next load signs in again
			}
			last = k
			if !send() {
				return
			}
			sent = time.Now()
		}
	}
}

// liveView is the view a live update renders with: the session's role
// and token, so an operator's rows keep their forms.
func (s *Server) liveView(ss *access.Session) view {
	return s.newView(ss, "", "", nil)
}

// fragment renders template name of page with body.
func (s *Server) fragment(page, name, id string, v view, body any) (patch, error) {
	v.Body = body
	var buf bytes.Buffer
	if err := s.pages[page].ExecuteTemplate(&buf, name, v); err != nil {
		return patch{}, err
	}
	return patch{ID: id, HTML: buf.String()}, nil
}

func (s *Server) fleetLive(*http.Request, view) (func() string, func(view) ([]patch, error)) {
	key := func() string { return fmt.Sprint(s.cfg.Store.Gen(), s.cfg.Traffic.Gen()) }
	return key, func(v view) ([]patch, error) {
		p, err := s.fragment("fleet", "pools", "pools", v, s.fleet())
		return []patch{p}, err
	}
}

func (s *Server) poolLive(r *http.Request, _ view) (func() string, func(view) ([]patch, error)) {
	name, after := r.PathValue("name"), r.URL.Query().Get("after")
	key := func() string { return fmt.Sprint(s.cfg.Store.PoolGen(name), s.cfg.Traffic.Gen()) }
	return key, func(v view) ([]patch, error) {
		b := s.pool(name, after)
		if !b.Known {
			return []patch{}, nil
		}
		st, err := s.fragment("pool", "poolstatus", "pool-status", v, b)
		if err != nil {
			return nil, err
		}
		px, err := s.fragment("pool", "proxies", "pool-proxies", v, b)
		return []patch{st, px}, err
	}
}

func (s *Server) targetsLive(*http.Request, view) (func() string, func(view) ([]patch, error)) {
	key := func() string { return fmt.Sprint(s.cfg.Store.TargetsGen()) }
	return key, func(v view) ([]patch, error) {
		p, err := s.fragment("targets", "targets", "targets", v, s.targets())
		return []patch{p}, err
	}
}

func (s *Server) eventsLive(r *http.Request, _ view) (func() string, func(view) ([]patch, error)) {
	q := r.URL.Query()
	pool, proxy := q.Get("pool"), q.Get("proxy")
	key := func() string { return fmt.Sprint(s.cfg.Tail.Gen()) }
	return key, func(v view) ([]patch, error) {
		p, err := s.fragment("events", "tail", "event-tail", v, s.eventsOf(pool, proxy))
		return []patch{p}, err
	}
}

func (s *Server) gatewayLive(*http.Request, view) (func() string, func(view) ([]patch, error)) {
	key := func() string { return fmt.Sprint(s.cfg.Traffic.Gen(), s.cfg.Store.Gen()) }
	return key, func(v view) ([]patch, error) {
		p, err := s.fragment("gateway", "gw", "gateway-body", v, s.gateway())
		return []patch{p}, err
	}
}
