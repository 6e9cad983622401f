// Package web serves the console: server-rendered pages that read
// without JavaScript (/, /pools/<name>, /targets, /events, /gateway),
// their live updates as Server-Sent Events (/live + the page's path),
// the actions an operator confirms (POSTs under the page they act on),
// and sign-in. Every response carries a strict Content-Security-Policy;
// every HTML page a Server-Timing header with the time it took to build.
package web

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/services/console/internal/access"
	"proxyfleet/services/console/internal/fleetview"
	"proxyfleet/services/console/internal/tail"
	"proxyfleet/services/console/internal/traffic"
)

//go:embed assets/templates/*.html
var templateFS embed.FS

//go:embed assets/static
var staticFS embed.FS

// CSP is the Content-Security-Policy of every response: scripts, styles
// and connections only from the console itself, no inline script or
// style, no framing.
const CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// CookieName is the session cookie.
const CookieName = "proxyfleet_console"

// Actions are the operator API calls the console makes ([api.Client]).
type Actions interface {
	PoolGet(ctx context.Context, name string) (api.PoolView, error)
	PoolApply(ctx context.Context, spec events.PoolSpec) (api.PoolView, error)
	PoolDelete(ctx context.Context, name string) (api.PoolView, error)
	Recycle(ctx context.Context, req api.ProxyRecycleRequest) (events.ProxyView, error)
	ReportBan(ctx context.Context, req api.ProxyBanRequest) (events.ProxyView, error)
}

var _ Actions = (*api.Client)(nil)

// Config is what a [Server] reads and calls.
type Config struct {
	Store   *fleetview.Store
	Traffic *traffic.Stats
	Tail    *tail.Tail
	API     Actions
	// Users are the users who may sign in; nil is the open mode: every
	// visitor is an operator without signing in (loopback only, which the
	// command checks).
	Users access.Users
	// PageSize is the number of proxies on one page of a pool (100 when 0).
	PageSize int
	// Coalesce is the least time between two live updates of one page
	// (500ms when 0); Refresh the most (10s when 0), so ages stay true.
	Coalesce, Refresh time.Duration
	// HistoryEvery is the time between two points of the pools' history,
	// for the page's words (10s when 0).
	HistoryEvery time.Duration
	Log          *slog.Logger
	Meter        metric.Meter
}

// Server is the console's HTTP handler. Create it with [New].
type Server struct {
	cfg      Config
	pages    map[string]*template.Template
	sessions *access.Sessions
	static   http.Handler
	stop     chan struct{}
	// login bounds the bcrypt comparisons running at once.
	login chan struct{}
	m     metrics
}

type metrics struct {
	pages   metric.Int64Counter
	actions metric.Int64Counter
	render  metric.Float64Histogram
	streams metric.Int64UpDownCounter
	patches metric.Int64Counter
}

// New returns the console's server.
func New(cfg Config) (*Server, error) {
	if cfg.PageSize <= 0 {
		cfg.PageSize = 100
	}
	if cfg.Coalesce <= 0 {
		cfg.Coalesce = 500 * time.Millisecond
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = 10 * time.Second
	}
	if cfg.HistoryEvery <= 0 {
		cfg.HistoryEvery = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Meter == nil {
		cfg.Meter = noop.NewMeterProvider().Meter("console")
	}
	pages, err := parseTemplates()
	if err != nil {
		return nil, err
	}
	sub, err := fs.Sub(staticFS, "assets/static")
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, pages: pages, sessions: access.NewSessions(), static: http.StripPrefix("/static/", http.FileServerFS(sub)),
		stop: make(chan struct{}), login: make(chan struct{}, 2)}
	if err := s.initMetrics(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Server) initMetrics() error {
	m := s.cfg.Meter
	var err error
	if s.m.pages, err = m.Int64Counter("console.pages", metric.WithDescription("pages served, by page and status")); err != nil {
		return err
	}
	if s.m.actions, err = m.Int64Counter("console.actions", metric.WithDescription("actions performed, by action and outcome")); err != nil {
		return err
	}
	if s.m.render, err = m.Float64Histogram("console.render.duration", metric.WithUnit("s"), metric.WithDescription("time to build a page"),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)); err != nil {
		return err
	}
	if s.m.streams, err = m.Int64UpDownCounter("console.live.streams", metric.WithDescription("live update streams open")); err != nil {
		return err
	}
	if s.m.patches, err = m.Int64Counter("console.live.patches", metric.WithDescription("live updates sent")); err != nil {
		return err
	}
	return nil
}

// pageNames are the templates of whole pages, each with the layout.
var pageNames = []string{"fleet", "pool", "targets", "events", "gateway", "confirm", "message", "login"}

func parseTemplates() (map[string]*template.Template, error) {
	base, err := template.New("layout").Funcs(funcs).ParseFS(templateFS, "assets/templates/layout.html")
	if err != nil {
		return nil, err
	}
	out := map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := base.Clone()
		if err != nil {
			return nil, err
		}
		if _, err := t.ParseFS(templateFS, "assets/templates/"+name+".html"); err != nil {
			return nil, err
		}
		out[name] = t
	}
	return out, nil
}

// OnShutdown ends the live streams: give it to http.Server.RegisterOnShutdown.
func (s *Server) OnShutdown() {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
}

// Handler is the console's routes, behind the security headers.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /static/", s.static)
	mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/static/favicon.svg", http.StatusMovedPermanently)
	})
	mux.HandleFunc("GET /{$}", s.page("fleet", s.fleetData))
	mux.HandleFunc("GET /pools/{name}", s.page("pool", s.poolData))
	mux.HandleFunc("GET /targets", s.page("targets", s.targetsData))
	mux.HandleFunc("GET /events", s.page("events", s.eventsData))
	mux.HandleFunc("GET /gateway", s.page("gateway", s.gatewayData))
	mux.HandleFunc("GET /live/{$}", s.live(s.fleetLive))
	mux.HandleFunc("GET /live/pools/{name}", s.live(s.poolLive))
	mux.HandleFunc("GET /live/targets", s.live(s.targetsLive))
	mux.HandleFunc("GET /live/events", s.live(s.eventsLive))
	mux.HandleFunc("GET /live/gateway", s.live(s.gatewayLive))
	// No other page has live updates: 204 tells an EventSource to stop.
	mux.HandleFunc("GET /live/", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("POST /pools/{name}/scale", s.action("scale"))
	mux.HandleFunc("POST /pools/{name}/delete", s.action("delete"))
	mux.HandleFunc("POST /pools/{name}/proxies/{id}/recycle", s.action("recycle"))
	mux.HandleFunc("POST /pools/{name}/proxies/{id}/ban", s.action("ban"))
	mux.HandleFunc("GET /login", s.loginPage)
	mux.HandleFunc("POST /login", s.loginPost)
	mux.HandleFunc("POST /logout", s.logout)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/", s.notFound)
	return headers(mux)
}

// headers sets the security headers of every response.
func headers(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", CSP)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		if !strings.HasPrefix(r.URL.Path, "/static/") {
			h.Set("Cache-Control", "no-store")
		}
		next.ServeHTTP(w, r)
	})
}

// view is what every page template reads.
type view struct {
	Title   string
	Nav     string
	Open    bool
	Session *access.Session
	CanAct  bool
	CSRF    string
	Now     time.Time
	Body    any
	// Live is whether the page has live updates at /live + its path:
	// console.js opens a stream only then.
	Live bool
}

// open reports whether the console runs without users.
func (s *Server) open() bool { return s.cfg.Users == nil }

// session returns the request's session; in the open mode a visitor
// without one gets a new operator session (and its cookie).
func (s *Server) session(w http.ResponseWriter, r *http.Request) *access.Session {
	if c, err := r.Cookie(CookieName); err == nil {
		if ss, ok := s.sessions.Get(c.Value); ok {
			return ss
		}
	}
	if !s.open() {
		return nil
	}
	ss := s.sessions.New("loopback", access.Operator)
	setCookie(w, ss.ID)
	return ss
}

func setCookie(w http.ResponseWriter, id string) {
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: id, Path: "/", HttpOnly: true, Secure: true, SameSite: http.SameSiteStrictMode})
}

func (s *Server) newView(ss *access.Session, title, nav string, body any) view {
	v := view{Title: title, Nav: nav, Open: s.open(), Session: ss, Now: time.Now().UTC(), Body: body}
	if ss != nil {
		v.CanAct = ss.Role.CanAct()
		v.CSRF = ss.CSRF
	}
	return v
}

// errNotFound makes a page answer 404 with its own text.
type pageError struct {
	status int
	title  string
	text   string
}

func (e *pageError) Error() string { return e.text }

// builder builds one page's title and body for a request.
type builder func(r *http.Request) (title string, body any, err error)

// page serves one page: the session (or the sign-in), the page built
// into a buffer, Server-Timing with the time that took, then the bytes.
func (s *Server) page(name string, build builder) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		ss := s.session(w, r)
		if ss == nil {
			http.Redirect(w, r, "/login", http.StatusSeeOther)
			return
		}
		title, body, err := build(r)
		if err != nil {
			var pe *pageError
			if errors.As(err, &pe) {
				s.message(w, r, ss, pe.status, pe.title, pe.text, "/")
				return
			}
			s.cfg.Log.Error("a page failed", "page", name, "err", err)
			s.message(w, r, ss, http.StatusInternalServerError, "The page failed", "The console could not build this page; its log says why.", "/")
			return
		}
		v := s.newView(ss, title, navOf(name), body)
		v.Live = true
		s.render(w, r, name, http.StatusOK, start, v)
	}
}

func navOf(page string) string {
	if page == "pool" {
		return "fleet"
	}
	return page
}

// render executes page into a buffer and writes it with Server-Timing.
func (s *Server) render(w http.ResponseWriter, r *http.Request, page string, status int, start time.Time, v view) {
	var buf bytes.Buffer
	buf.Grow(64 << 10)
	if err := s.pages[page].ExecuteTemplate(&buf, "layout", v); err != nil {
		s.cfg.Log.Error("a page does not render", "page", page, "err", err)
		http.Error(w, "the page does not render; the console's log says why", http.StatusInternalServerError)
		return
	}
	d := time.Since(start)
	h := w.Header()
	h.Set("Server-Timing", fmt.Sprintf("render;dur=%.3f", float64(d.Microseconds())/1000))
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
	attrs := metric.WithAttributes(attribute.String("page", page), attribute.Int("status", status))
	s.m.pages.Add(r.Context(), 1, attrs)
	s.m.render.Record(r.Context(), d.Seconds(), metric.WithAttributes(attribute.String("page", page)))
}

type messageBody struct {
	Title, Text, Back string
}

// message answers a page of one sentence with status.
func (s *Server) message(w http.ResponseWriter, r *http.Request, ss *access.Session, status int, title, text, back string) {
	s.render(w, r, "message", status, time.Now(), s.newView(ss, title, "", messageBody{Title: title, Text: text, Back: back}))
}

func (s *Server) notFound(w http.ResponseWriter, r *http.Request) {
	ss := s.session(w, r)
	if ss == nil {
		http.Redirect(w, r, "/login", http.StatusSeeOther)
		return
	}
	s.message(w, r, ss, http.StatusNotFound, "No such page", "The console has no page at "+r.URL.Path+".", "/")
}

// IsLoopback reports whether addr (host:port) listens on loopback only.
func IsLoopback(addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, err
	}
	if host == "localhost" {
		return true, nil
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback(), nil
}
