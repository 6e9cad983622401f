package reqlog

import (
	"bufio"
	"context"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"proxyfleet/pkg/events"
	"proxyfleet/services/gateway/internal/site"
)

// ProxyHeader is the header the forward proxy names the proxy that
// carried an answer by (forward.ProxyHeader): an answer without it is
// the gateway's own.
const ProxyHeader = "X-Proxyfleet-Proxy"

// Record is one request's record while it is served. Its methods are
// called from the request's goroutine, except the count of bytes read
// from the request body, which the transport may read from another.
type Record struct {
	l     *Logger
	ctx   context.Context
	start time.Time
	r     events.GatewayRequest
	up    atomic.Int64

	wrote, writeErr, proxyAnswer, proxyError, hijacked, tunneled bool
	down                                                         int64
}

// Start begins the record of request r: it returns the record, a writer
// wrapping w that notes the status and bytes sent, and r with a body that
// counts the bytes read. On a nil logger it returns nil, w and r.
func (l *Logger) Start(w http.ResponseWriter, r *http.Request) (*Record, http.ResponseWriter, *http.Request) {
	if l == nil {
		return nil, w, r
	}
	rec := &Record{l: l, ctx: r.Context(), start: time.Now()}
	rec.r = events.GatewayRequest{Time: rec.start.UTC(), Gateway: l.cfg.Gateway, Method: r.Method, Proxies: []string{}}
	if r.Method == http.MethodConnect {
		rec.r.Host = r.Host
	} else if r.URL != nil {
		// Never the URL's user info, nor its query without KeepQuery.
		rec.r.Scheme, rec.r.Host, rec.r.Path = r.URL.Scheme, r.URL.Host, r.URL.EscapedPath()
		if l.cfg.KeepQuery && r.URL.RawQuery != "" {
			rec.r.Path += "?" + r.URL.RawQuery
		}
		if len(rec.r.Path) > maxPath {
			rec.r.Path = rec.r.Path[:maxPath]
		}
	}
	rec.r.Site = site.Key(rec.r.Host)
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = &countingBody{ReadCloser: r.Body, n: &rec.up}
	}
	return rec, &writer{ResponseWriter: w, rec: rec}, r
}

// Target notes the pool and session the client's username named.
func (rec *Record) Target(pool, session string) {
	if rec != nil {
		rec.r.Pool, rec.r.Session = pool, session
	}
}

// Finish ends the record and queues it when it is sampled.
func (l *Logger) Finish(rec *Record) {
	if l == nil || rec == nil {
		return
	}
	out := rec.result()
	if !l.Sample(&out) {
		l.sampledOut.Add(1)
		return
	}
	l.Log(&out)
}

// result is the finished record.
func (rec *Record) result() events.GatewayRequest {
	out := rec.r
	out.Attempts = len(out.Proxies)
	out.DurationMS = math.Round(float64(time.Since(rec.start).Microseconds())) / 1000
	if !rec.tunneled {
		out.BytesUp, out.BytesDown = rec.up.Load(), rec.down
	}
	switch {
	case rec.tunneled:
		out.Status, out.Outcome = http.StatusOK, events.RequestOK
	case rec.hijacked || !rec.wrote:
		out.Outcome = events.RequestClientGone
		if !rec.hijacked && rec.ctx.Err() == nil {
			// The handler answered nothing: net/http sends an empty 200.
			out.Status, out.Outcome = http.StatusOK, events.RequestError
		}
	case rec.writeErr:
		out.Outcome = events.RequestAborted
	case rec.proxyError:
		out.Outcome = events.RequestProxyError
	case rec.proxyAnswer:
		out.Outcome = events.RequestOK
	default:
		out.Outcome = events.RequestError
	}
	return out
}

// recordOf is the record behind w, or nil.
func recordOf(w http.ResponseWriter) *Record {
	if rw, ok := w.(*writer); ok {
		return rw.rec
	}
	return nil
}

// Tried notes that the request is tried on proxy id of pool, which
// becomes the record's tier (w is the writer [Logger.Start] returned; on
// another writer it does nothing).
func Tried(w http.ResponseWriter, id, pool string) {
	if rec := recordOf(w); rec != nil {
		rec.r.Proxies = append(rec.r.Proxies, id)
		rec.r.Tier = pool
	}
}

// Banned notes that the answer matched the pool's ban rule.
func Banned(w http.ResponseWriter, rule string) {
	if rec := recordOf(w); rec != nil {
		rec.r.Ban = rule
	}
}

// Tunneled notes a tunnel that opened and carried up bytes from the
// client and down bytes to it before it closed.
func Tunneled(w http.ResponseWriter, up, down int64) {
	if rec := recordOf(w); rec != nil {
		rec.tunneled = true
		rec.r.BytesUp, rec.r.BytesDown = up, down
	}
}

// writer notes what the handler sends. It keeps the writer's optional
// interfaces the forward proxy uses: Hijack (tunnels), Flush, and Unwrap
// for http.ResponseController (read deadlines of idle bodies).
type writer struct {
	http.ResponseWriter
	rec *Record
}

func (w *writer) WriteHeader(code int) {
	if !w.rec.wrote && code >= 200 {
		w.rec.wrote = true
		w.rec.r.Status = code
		h := w.Header()
		w.rec.proxyAnswer = h.Get(ProxyHeader) != ""
		w.rec.proxyError = w.rec.proxyAnswer && h.Get(events.ProxyErrorHeader) != ""
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *writer) Write(b []byte) (int, error) {
	if !w.rec.wrote {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(b)
	w.rec.down += int64(n)
	if err != nil {
		w.rec.writeErr = true
	}
	return n, err
}

func (w *writer) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	hj, ok := w.ResponseWriter.(http.Hijacker)
	if !ok {
		return nil, nil, errors.New("reqlog: the response writer cannot be hijacked")
	}
	c, rw, err := hj.Hijack()
	if err == nil {
		w.rec.hijacked = true
	}
	return c, rw, err
}

func (w *writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// countingBody counts the bytes read from a request body.
type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}
