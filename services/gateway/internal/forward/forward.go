// Package forward is the gateway's client side: an HTTP forward proxy
// (absolute-form requests and CONNECT tunnels) that authenticates each
// client, picks a ready proxy of the pool its username names
// (route.Table), relays the request through that proxy with the pool's
// own credentials, retries a failed attempt on another proxy, shows plain
// HTTP responses to the pool's ban rules (retrying a ban page on another
// proxy, keeping a proxy a site banned off that site), goes on to the
// pool's fallback pools when none of its proxies may serve a request
// (tiers.go), and counts what it carried.
//
// What it learns of the fleet (credentials, ban rules) and what it tells
// the fleet (suspect proxies, bans) go through [Fleet]; the NATS side
// lives in package fleet.
package forward

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/hop"
	"proxyfleet/pkg/idle"
	"proxyfleet/services/gateway/internal/ban"
	"proxyfleet/services/gateway/internal/cooldown"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
	"proxyfleet/services/gateway/internal/site"
)

// ProxyHeader names the proxy that carried a plain HTTP response (and a
// CONNECT tunnel, in the 200 that opens it).
const ProxyHeader = "X-Proxyfleet-Proxy"

// AttemptsHeader is on every answer to a plain HTTP request, relayed or
// the gateway's own: how many proxies the request was sent through.
const AttemptsHeader = "X-Proxyfleet-Attempts"

// BannedHeader names the ban rule a relayed response matched: no attempt
// was left to try another proxy, so the crawler gets the last ban page.
const BannedHeader = "X-Proxyfleet-Banned"

// maxHeldBan is the largest ban page kept whole while the request is
// retried, delivered when no later attempt answers; the connection of a
// larger one is closed instead of drained.
const maxHeldBan = events.BanBodyLimit

// maxReplayBody is the largest request body kept so a failed attempt can
// be repeated on another proxy; a request with a larger body is sent once.
const maxReplayBody = 1 << 20

// Fleet is what the server needs of the fleet beyond the routing table.
type Fleet interface {
	// Known reports whether pool exists.
	Known(pool string) bool
	// Credentials returns the basic-auth pair proxy x demands (user ""
	// when it demands none); an error says why the gateway cannot open
	// the pool's password (yet).
	Credentials(x route.Proxy) (user, password string, err error)
	// Rules returns pool's compiled ban rules (nil: none).
	Rules(pool string) []ban.Rule
	// Suspect reports a proxy that failed a request, so health probes it
	// at once. It must not block.
	Suspect(id, reason string)
	// Banned reports a proxy a ban rule found banned. It must not block.
	Banned(pool string, v ban.Verdict)
}

// CooldownSharer is an optional capability of a [Fleet]: it tells the
// other gateways of a cooldown this server decided (package fleet writes
// it to the fleet-gateway-cooldowns bucket, and adds theirs to the
// server's [Config.Cooldowns]). It must not block.
type CooldownSharer interface {
	ShareCooldown(e cooldown.Entry)
}

// ownLimit reports whether a dial failed for want of this process's or
// this machine's resources (descriptors, local ports), not because of the
// proxy: no proxy is blamed or cooled for it.
func ownLimit(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.EADDRNOTAVAIL)
}

// copyBufs are the buffers plain HTTP responses are copied through.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// Authenticator decides whether the client at address client (an IP)
// may use pool with password. An error that has a RetryAfter()
// time.Duration method refuses the attempt unchecked: the client failed
// too many logins lately ([Throttled]).
type Authenticator func(client, pool, password string) (bool, error)

// Throttled is the part of an [Authenticator]'s error the server answers
// 429 by, with a Retry-After of RetryAfter, rounded up to seconds.
type Throttled interface {
	error
	RetryAfter() time.Duration
}

// Config configures a [Server].
type Config struct {
	Table *route.Table
	Fleet Fleet
	Auth  Authenticator
	Log   *slog.Logger
	// Metrics records what the server carried (nil: nothing is recorded
	// beyond [Server.Stats]).
	Metrics *Metrics
	// DialTimeout bounds the connection to a proxy and, for a tunnel, its
	// answer to CONNECT.
	DialTimeout time.Duration
	// ResponseTimeout bounds the wait for a proxy's response headers to a
	// plain HTTP request.
	ResponseTimeout time.Duration
	// Cooldown is how long new connections avoid a proxy that failed one
	// (route.Table.Cool); the failure is reported to health once per
	// cooldown. Default 10s.
	Cooldown time.Duration
	// BodyTimeout is how long a request body may go without a byte
	// arriving before the request is answered 408 (idle.Body); 0: unbounded.
	BodyTimeout time.Duration
	// TunnelIdleTimeout closes a CONNECT tunnel that carried nothing
	// either way for as long (idle.Tunnel), and an intercepted one that
	// waited as long for its next request; 0: unbounded.
	TunnelIdleTimeout time.Duration
	// Cooldowns are the proxies kept off a site, shared with the Fleet
	// (nil: a set of this server's own).
	Cooldowns *cooldown.Set
	// CA signs the certificates of intercepting pools' connections
	// (gateway.intercept); nil: such pools are answered 503.
	CA CA
	// OriginRoots verifies the certificates of https:// origins (an
	// absolute-form https:// request, or one inside an intercepted
	// tunnel); nil: the system's roots ([OriginRoots]).
	OriginRoots *x509.CertPool
	// RequestLog records each client request (nil: none).
	RequestLog *reqlog.Logger
	// Now is the clock of the tier memory (nil: time.Now).
	Now func() time.Time
}

// Server is the gateway's http.Handler.
type Server struct {
	cfg      Config
	dial     func(ctx context.Context, network, addr string) (net.Conn, error)
	detector *ban.Detector
	stats    *Stats
	// transports are the transports plain HTTP requests go through, one
	// per proxy and the credentials it is sent (transports.go).
	transports transports
	// intercepted serves intercepted connections (intercept.go).
	intercepted interceptServer
	// tierMemory holds the fallback pools sites needed lately (tiers.go).
	tierMemory tierMemory
}

// connectKey is the context key of a request's [connectAnswer].
type connectKey struct{}

// connectAnswer keeps a proxy's answer to the CONNECT the transport sent
// for an https:// request, which the transport reduces to an error.
type connectAnswer struct {
	mu     sync.Mutex
	status int
	text   string
	header http.Header
}

func (a *connectAnswer) set(resp *http.Response) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.status, a.text, a.header = resp.StatusCode, resp.Status, resp.Header.Clone()
}

// get returns the answer, or nil when the proxy answered none (or a is
// nil: no CONNECT was sent).
func (a *connectAnswer) get() *http.Response {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.status == 0 {
		return nil
	}
	return &http.Response{StatusCode: a.status, Status: a.text, Header: a.header}
}

// New returns a server for cfg.
func New(cfg Config) *Server {
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.ResponseTimeout <= 0 {
		cfg.ResponseTimeout = 60 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Cooldown <= 0 {
		cfg.Cooldown = 10 * time.Second
	}
	if cfg.Cooldowns == nil {
		cfg.Cooldowns = cooldown.NewSet(events.MaxRetireAfterSitesWindow, nil)
	}
	dialer := &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second}
	return &Server{
		cfg:      cfg,
		dial:     hop.Dialer(dialer.DialContext),
		detector: ban.NewDetector(nil),
		stats:    newStats(cfg.Metrics),
	}
}

// Stats returns the server's counters.
func (s *Server) Stats() *Stats { return s.stats }

// Forget drops what the server holds of a proxy that left the fleet.
func (s *Server) Forget(id string) {
	s.detector.Forget(id)
	s.transports.forget(id)
	s.stats.forget(id)
}

// Rearm lets the ban rules report proxy id again: its last report did not
// reach the planner.
func (s *Server) Rearm(id string) { s.detector.Forget(id) }

// Close releases idle connections to the proxies and closes intercepted
// connections.
func (s *Server) Close() {
	s.intercepted.close()
	s.transports.closeIdle()
}

// ServeHTTP authenticates the client, then tunnels a CONNECT or relays an
// absolute-form request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rec, w, r := s.cfg.RequestLog.Start(w, r)
	defer s.cfg.RequestLog.Finish(rec)
	if r.Method != http.MethodConnect {
		// Refused before any attempt; relay counts them from here.
		w.Header().Set(AttemptsHeader, "0")
	}
	if r.Method != http.MethodConnect && !r.URL.IsAbs() {
		http.Error(w, "proxyfleet gateway: this is a forward proxy; send absolute-form requests (GET http://host/path) or CONNECT host:port, with Proxy-Authorization naming the pool", http.StatusBadRequest)
		return
	}
	user, password, ok := proxyAuth(r.Header.Get("Proxy-Authorization"))
	if !ok {
		denied(w, "proxy authentication required: use the username "+route.UserGrammar)
		return
	}
	target, err := route.ParseUser(user)
	if err != nil {
		denied(w, err.Error())
		return
	}
	target.Client = clientHost(r.RemoteAddr)
	rec.Target(target.Pool, target.Session)
	target.Site = requestSite(r)
	allowed, err := s.cfg.Auth(target.Client, target.Pool, password)
	if th, ok := errors.AsType[Throttled](err); ok {
		secs := int((th.RetryAfter() + time.Second - 1) / time.Second)
		w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
		http.Error(w, "proxyfleet gateway: "+th.Error(), http.StatusTooManyRequests)
		return
	}
	if err != nil || !allowed {
		denied(w, fmt.Sprintf("wrong password for pool %q", target.Pool))
		return
	}
	if !s.cfg.Fleet.Known(target.Pool) {
		http.Error(w, fmt.Sprintf("proxyfleet gateway: no pool named %q (fleet.api.pool.list lists them)", target.Pool), http.StatusNotFound)
		return
	}
	ps := s.stats.pool(target.Pool)
	ps.begin()
	defer ps.end()
	if r.Method == http.MethodConnect {
		s.tunnel(w, r, target)
		return
	}
	s.relay(w, r, target)
}

// requestSite is the site of a request, which the pool's per-site limits
// apply to: that of a CONNECT's host or of an absolute URL's.
func requestSite(r *http.Request) string {
	if r.Method == http.MethodConnect {
		return site.Key(r.Host)
	}
	return site.Key(r.URL.Host)
}

// clientHost is the IP of a client's address, whom sessions and failed
// logins count against.
func clientHost(addr string) string {
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}

func denied(w http.ResponseWriter, msg string) {
	w.Header().Set("Proxy-Authenticate", `Basic realm="proxyfleet"`)
	http.Error(w, "proxyfleet gateway: "+msg, http.StatusProxyAuthRequired)
}

// proxyAuth decodes a Basic Proxy-Authorization value.
func proxyAuth(h string) (user, password string, ok bool) {
	scheme, cred, found := strings.Cut(h, " ")
	if !found || !strings.EqualFold(scheme, "Basic") {
		return "", "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", "", false
	}
	return strings.Cut(string(raw), ":")
}

// retryable reports whether a proxy's status means it, not the client's
// request, failed: the request is tried on another proxy.
func retryable(status int) bool {
	return status == http.StatusBadGateway || status == http.StatusServiceUnavailable || status == http.StatusGatewayTimeout
}

// proxyFailed reports whether a response to a plain HTTP request is the
// proxy's own failure (a retryable status on an error page the proxy
// made) rather than the site's answer, which is relayed as it is:
// retrying a site's 503 on other proxies would multiply the load on a
// site asking for less, and cool healthy proxies.
//
// Only [events.ProxyErrorHeader] marks a proxy's own page: every proxy
// proxyfleet runs sets it on the pages it makes and removes it from the
// origin's responses (the built-in proxy in Go, Squid by the lines of
// egress.SquidMarkOwnErrors), so no site can fake a proxy's failure and
// have the request retried on every proxy, each cooled and reported.
// Squid's X-Squid-Error is not trusted: an origin's copy passes through
// Squid.
func proxyFailed(resp *http.Response) bool {
	return retryable(resp.StatusCode) && resp.Header.Get(events.ProxyErrorHeader) != ""
}

// upstream returns the transport that carries requests through x, with
// the pool's credentials when the proxy demands them.
func (s *Server) upstream(x route.Proxy) (*http.Transport, error) {
	user, pw, err := s.cfg.Fleet.Credentials(x)
	if err != nil {
		return nil, err
	}
	return s.transports.get(x.ID, transportKey{address: x.Address, user: user, password: pw}, s.newTransport), nil
}

// replayBody reads r's body so it can be sent again; ok is false when it
// is too large to keep, and body then streams it once.
func replayBody(r *http.Request) (body []byte, rest io.Reader, ok bool, err error) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return nil, nil, true, nil
	}
	if r.ContentLength > maxReplayBody {
		return nil, r.Body, false, nil
	}
	buf, err := io.ReadAll(io.LimitReader(r.Body, maxReplayBody+1))
	if err != nil {
		return nil, nil, false, err
	}
	if len(buf) > maxReplayBody {
		return nil, io.MultiReader(bytes.NewReader(buf), r.Body), false, nil
	}
	return buf, nil, true, nil
}

// relay sends a plain HTTP request through a proxy of target's pool,
// trying others when the proxy fails before answering or relays a ban page
// (a response a ban rule matches). Every answer carries [AttemptsHeader].
func (s *Server) relay(w http.ResponseWriter, r *http.Request, target route.Target) {
	start := time.Now()
	w.Header().Set(AttemptsHeader, "0")
	r.Body = idle.Body(w, r, s.cfg.BodyTimeout)
	if r.Body != nil {
		defer func() { _ = r.Body.Close() }()
	}
	body, stream, replayable, err := replayBody(r)
	if errors.Is(err, idle.ErrBodyStalled) {
		s.stalled(w, target.Pool, start)
		return
	}
	if err != nil {
		http.Error(w, "proxyfleet gateway: reading the request body: "+err.Error(), http.StatusBadRequest)
		return
	}
	// target.Site is site.Key of the URL's host (of the CONNECT's host
	// for an intercepted request, which is the URL's): found once.
	siteKey := target.Site
	if siteKey == "" {
		host := r.URL.Host
		if host == "" {
			host = r.Host
		}
		siteKey = site.Key(host)
	}
	tiers := s.tiers(target, siteKey)
	if !replayable {
		// The body is sent once: no other pool can be tried.
		tiers = tiers[:1]
	}
	a := &attempts{site: siteKey, target: target}
	for i, pool := range tiers {
		tier := target
		tier.Pool = pool
		a.moreTiers = i < len(tiers)-1
		retries := s.cfg.Table.Spec(pool).RetriesOrDefault()
		if !replayable {
			retries = 0
		}
		answered := s.tryProxies(r.Context(), w, tier, a.site, retries, !a.moreTiers, start, func(x route.Proxy, last bool) bool {
			a.made++
			a.tried = append(a.tried, x.ID)
			w.Header().Set(AttemptsHeader, strconv.Itoa(a.made))
			return s.relayOnce(w, r, x, body, stream, last, start, a)
		}, func() bool { return a.deliverHeld(w) })
		if answered {
			s.served(target, siteKey, a.served, tiers[0])
			return
		}
	}
}

// attempts is what the attempts of one plain HTTP request share.
type attempts struct {
	site string
	// target is the client's target (its labels select the proxies of
	// every tier).
	target route.Target
	// moreTiers is set while a fallback pool follows the one tried.
	moreTiers bool
	// served is the pool whose proxy's answer, not a ban page, reached
	// the client.
	served string
	// header is the request's header without its hop-by-hop fields, which
	// every attempt sends (made by the first).
	header http.Header
	made   int
	// tried are the proxies tried so far, the current one included.
	tried []string
	// held is the last ban page whose request was retried, delivered
	// when no later attempt answers.
	held *heldBan
}

// heldBan is a ban page kept whole while its request is retried.
type heldBan struct {
	proxy  string
	pool   string
	rule   string
	status int
	header http.Header
	body   []byte
}

// deliverHeld answers with the held ban page, if any.
func (a *attempts) deliverHeld(w http.ResponseWriter) bool {
	if a.held == nil {
		return false
	}
	h := w.Header()
	for k, vs := range a.held.header {
		h[k] = vs
	}
	a.setHeaders(h, a.held.proxy, a.held.pool, a.held.rule)
	w.WriteHeader(a.held.status)
	_, _ = w.Write(a.held.body)
	return true
}

// setHeaders sets the gateway's own headers on a relayed response (over
// any copy the origin sent): the proxy and its pool, the attempts and, for
// a ban page, the rule it matched.
func (a *attempts) setHeaders(h http.Header, proxy, pool, rule string) {
	h.Set(ProxyHeader, proxy)
	h.Set(PoolHeader, pool)
	h.Set(AttemptsHeader, strconv.Itoa(a.made))
	h.Del(BannedHeader)
	if rule != "" {
		h.Set(BannedHeader, rule)
	}
}

// tryProxies calls once with a proxy of target's pool that is not cooled
// for site (site.Key of the request's host), then, while once returns
// false (the attempt failed, or relayed a ban page, and another may be
// made), with another proxy not tried yet, up to retries times more; last
// tells once that no attempt follows, in this pool or a fallback pool.
// It reports whether the request was answered. When the attempts end
// without an answer and lastTier is false, nothing is answered: the
// caller goes on to the next pool. Otherwise held (when not nil) may
// answer with what an earlier attempt held back, or the request fails:
// 429 when the only proxies left are cooled for site, or stay at their
// per-site limits (target.Site) past the pool's queue timeout; 503 when
// none is ready (or none carries the selected labels).
func (s *Server) tryProxies(ctx context.Context, w http.ResponseWriter, target route.Target, site string, retries int, lastTier bool, start time.Time, once func(x route.Proxy, last bool) bool, held func() bool) bool {
	var tried []string
	for attempt := 0; attempt <= retries; attempt++ {
		cooled, until := s.cfg.Cooldowns.Cooled(target.Pool, site)
		x, err := s.cfg.Table.Acquire(ctx, target, append(cooled, tried...)...)
		if err != nil {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				s.fail(target.Pool, "", "client_gone", start)
				return true
			}
			if !lastTier {
				s.fail(target.Pool, "", s.noProxyKind(target, cooled, err), start)
				return false
			}
			if held != nil && held() {
				return true
			}
			if s.atLimit(w, target, err, start) {
				return true
			}
			s.noProxy(w, target, site, cooled, until, err, start)
			return true
		}
		reqlog.Tried(w, x.ID, x.Pool)
		done := once(x, attempt >= retries && lastTier)
		s.cfg.Table.Done(x)
		if done {
			return true
		}
		tried = append(tried, x.ID)
	}
	if !lastTier {
		return false
	}
	// Only a relayed request's last attempt ends without an answer, and
	// only with a ban page held.
	if held == nil || !held() {
		s.fail(target.Pool, "", "no_proxy", start)
		http.Error(w, "proxyfleet gateway: every attempt failed", http.StatusBadGateway)
	}
	return true
}

// noProxyKind is the metric outcome of a pool that had no proxy to try:
// at its per-site limits, cooled for the site, or none.
func (s *Server) noProxyKind(target route.Target, cooled []string, err error) string {
	if _, ok := errors.AsType[*route.LimitError](err); ok {
		return "site_limit"
	}
	if s.cooledReady(target, cooled) > 0 {
		return "site_cooldown"
	}
	return "no_proxy"
}

// cooledReady counts the ready proxies of target's pool, carrying its
// labels, among cooled.
func (s *Server) cooledReady(target route.Target, cooled []string) int {
	n := 0
	for _, x := range s.cfg.Table.Ready(target.Pool) {
		if slices.Contains(cooled, x.ID) && target.Matches(x) {
			n++
		}
	}
	return n
}

// atLimit answers a request no proxy could take under the pool's per-site
// limits (429, with Retry-After), or whose client left while it waited;
// false for any other outcome of [route.Table.Acquire].
func (s *Server) atLimit(w http.ResponseWriter, target route.Target, err error, start time.Time) bool {
	if lerr, ok := errors.AsType[*route.LimitError](err); ok {
		s.fail(target.Pool, "", "site_limit", start)
		secs := int((lerr.RetryAfter + time.Second - 1) / time.Second)
		w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
		http.Error(w, "proxyfleet gateway: "+lerr.Error()+"; slow down or retry later", http.StatusTooManyRequests)
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		s.fail(target.Pool, "", "client_gone", start)
		return true
	}
	return false
}

// noProxy answers a request no proxy is left to try for: 429 when ready
// proxies are left but cooled for the request's site, until the first of
// their cooldowns ends; 503 otherwise.
func (s *Server) noProxy(w http.ResponseWriter, target route.Target, siteKey string, cooled []string, until time.Time, err error, start time.Time) {
	ready := s.cooledReady(target, cooled)
	if ready == 0 {
		s.fail(target.Pool, "", "no_proxy", start)
		http.Error(w, "proxyfleet gateway: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	wait := max(time.Until(until), 0)
	secs := max(int((wait+time.Second-1)/time.Second), 1)
	s.fail(target.Pool, "", "site_cooldown", start)
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	http.Error(w, fmt.Sprintf("proxyfleet gateway: site %s banned the %d ready proxies of pool %q left to try (a cooldown ban rule matched their answers there); the first is usable there again in %ds", siteKey, ready, target.Pool, secs), http.StatusTooManyRequests)
}

// relayOnce makes one attempt through x. It returns false when another
// attempt may be made: the attempt failed before anything reached the
// client (never when last, unless a ban page is held for the client), or
// x relayed a ban page (never when last, nor when no other proxy is left
// to try).
func (s *Server) relayOnce(w http.ResponseWriter, r *http.Request, x route.Proxy, body []byte, stream io.Reader, last bool, start time.Time, a *attempts) bool {
	// final: no attempt follows, and none held a ban page back to answer
	// with instead of this attempt's failure.
	final := last && a.held == nil
	transport, err := s.upstream(x)
	if err != nil {
		// Not the proxy's fault: every proxy of the pool shares it.
		s.fail(x.Pool, x.ID, "no_credentials", start)
		http.Error(w, "proxyfleet gateway: pool "+x.Pool+": "+err.Error(), http.StatusServiceUnavailable)
		return true
	}
	ctx := r.Context()
	var answer *connectAnswer
	if r.URL.Scheme == "https" {
		// The transport sends a CONNECT first; its answer is kept.
		answer = &connectAnswer{}
		ctx = context.WithValue(ctx, connectKey{}, answer)
	}
	ctx, listed := hop.Track(ctx)
	if a.header == nil {
		a.header = r.Header.Clone()
		hop.Remove(a.header)
	}
	// A shallow copy: the transport changes neither the URL nor the
	// header it shares with r and the other attempts.
	out := r.WithContext(ctx)
	out.Header = a.header
	out.RequestURI = ""
	out.Close = false
	switch {
	case stream != nil:
		out.Body = io.NopCloser(stream)
	case body != nil:
		out.Body = io.NopCloser(bytes.NewReader(body))
		out.ContentLength = int64(len(body))
	default:
		out.Body = nil
	}
	resp, err := transport.RoundTrip(out)
	if err != nil {
		if refusal := answer.get(); refusal != nil && refusal.StatusCode != http.StatusOK && r.Context().Err() == nil {
			// The proxy answered the CONNECT for an https:// request
			// and refused it: like a tunnel's refusal, it is relayed.
			return s.connectRefused(w, x, refusal, final, start)
		}
		return s.unreachable(w, r, x, err, final, start)
	}
	defer func() { _ = resp.Body.Close() }()
	if proxyFailed(resp) && !final {
		s.suspect(x, fmt.Sprintf("gateway: the proxy answered %d", resp.StatusCode))
		s.fail(x.Pool, x.ID, "proxy_status", start)
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return false
	}
	var head []byte
	var banned string
	if rules := s.cfg.Fleet.Rules(x.Pool); len(rules) > 0 {
		if ban.NeedsBody(rules) {
			head, _ = io.ReadAll(io.LimitReader(resp.Body, events.BanBodyLimit))
		}
		match, v, verdict := s.detector.Observe(x.ID, a.site, rules, resp.StatusCode, resp.Header, head)
		if verdict {
			s.verdict(x, v)
		}
		if match != "" {
			reqlog.Banned(w, match)
		}
		if match != "" && !last && (a.moreTiers || s.otherProxy(x.Pool, a)) {
			a.hold(x, match, resp, head, listed.Fields())
			s.fail(x.Pool, x.ID, "banned", start)
			return false
		}
		banned = match
	}
	h := w.Header()
	for k, vs := range resp.Header {
		h[k] = vs
	}
	hop.Remove(h, listed.Fields()...)
	a.setHeaders(h, x.ID, x.Pool, banned)
	if banned == "" && !proxyFailed(resp) {
		a.served = x.Pool
	}
	w.WriteHeader(resp.StatusCode)
	n, _ := w.Write(head)
	buf := copyBufs.Get().(*[]byte)
	// The struct hides w's ReadFrom, which would allocate a buffer of its
	// own per response.
	m, copyErr := io.CopyBuffer(struct{ io.Writer }{w}, resp.Body, *buf)
	copyBufs.Put(buf)
	up := int64(len(body))
	if r.ContentLength > 0 && stream != nil {
		up = r.ContentLength
	}
	outcome := "ok"
	switch {
	case copyErr != nil:
		outcome = "aborted"
	case proxyFailed(resp):
		outcome = "proxy_status"
	case banned != "":
		outcome = "banned"
	}
	s.stats.done(x, outcome, up, int64(n)+m, time.Since(start))
	return true
}

// otherProxy reports whether pool has a ready proxy that a's request did
// not try, that carries its labels and is not cooled for its site: only
// then (or when a fallback pool follows) is a ban page held back for
// another attempt.
func (s *Server) otherProxy(pool string, a *attempts) bool {
	cooled, _ := s.cfg.Cooldowns.Cooled(pool, a.site)
	for _, x := range s.cfg.Table.Ready(pool) {
		if !slices.Contains(a.tried, x.ID) && !slices.Contains(cooled, x.ID) && a.target.Matches(x) {
			return true
		}
	}
	return false
}

// hold reads the rest of a ban page x relayed, whose request is retried:
// one of at most maxHeldBan bytes is kept (its connection reused), in
// place of an earlier one; the connection of a larger one is closed
// unread. listed are the fields the response's Connection header listed,
// dropped as when it is relayed.
func (a *attempts) hold(x route.Proxy, rule string, resp *http.Response, head []byte, listed []string) {
	rest, err := io.ReadAll(io.LimitReader(resp.Body, int64(maxHeldBan-len(head)+1)))
	if err != nil || len(head)+len(rest) > maxHeldBan {
		return
	}
	header := resp.Header.Clone()
	hop.Remove(header, listed...)
	a.held = &heldBan{proxy: x.ID, pool: x.Pool, rule: rule, status: resp.StatusCode, header: header, body: append(head, rest...)}
}

// verdict acts on a ban rule's verdict on x: a cooldown keeps x off the
// site; a retire verdict reports x banned.
func (s *Server) verdict(x route.Proxy, v ban.Verdict) {
	s.stats.ban(x, v.Rule)
	if v.Action == events.BanActionCooldown {
		s.cool(x, v)
		return
	}
	s.cfg.Log.Info("proxy banned by rule", "proxy", x.ID, "pool", x.Pool, "rule", v.Rule, "matches", v.Matches)
	s.cfg.Fleet.Banned(x.Pool, v)
}

// cool keeps x off the site of a cooldown verdict, tells the other
// gateways, and reports x banned when it is now cooled on the pool's
// retireAfterSites distinct sites within its window.
func (s *Server) cool(x route.Proxy, v ban.Verdict) {
	now := time.Now()
	e := cooldown.Entry{Proxy: x.ID, Pool: x.Pool, Site: v.Site, Rule: v.Rule, At: now, Until: now.Add(v.Cooldown)}
	if !s.cfg.Cooldowns.Add(e) {
		return
	}
	s.cfg.Log.Info("proxy cooled for a site", "proxy", x.ID, "pool", x.Pool, "site", v.Site, "rule", v.Rule, "for", v.Cooldown.String())
	if sh, ok := s.cfg.Fleet.(CooldownSharer); ok {
		sh.ShareCooldown(e)
	}
	spec := s.cfg.Table.Spec(x.Pool)
	limit := spec.RetireAfterSitesOrDefault()
	if limit == 0 {
		return
	}
	n := s.cfg.Cooldowns.Sites(x.ID, spec.RetireAfterSitesWindowOrDefault())
	if n < limit || !s.detector.Report(x.ID) {
		return
	}
	reason := fmt.Sprintf("cooled on %d sites", n)
	s.cfg.Log.Info("proxy banned: cooled on too many sites", "proxy", x.ID, "pool", x.Pool, "sites", n, "within", spec.RetireAfterSitesWindowOrDefault().String())
	s.cfg.Fleet.Banned(x.Pool, ban.Verdict{Proxy: x.ID, Rule: reason, Action: events.BanActionRetire, Matches: n})
}

// unreachable handles an attempt whose proxy could not be reached (or
// broke the connection before answering): it returns true when the
// request is answered, false when another proxy may be tried.
func (s *Server) unreachable(w http.ResponseWriter, r *http.Request, x route.Proxy, err error, last bool, start time.Time) bool {
	switch {
	case idle.Stalled(r.Body):
		// The client stopped sending a body too large to keep: its fault,
		// not the proxy's. (The stall also ended r's context.)
		s.stalled(w, x.Pool, start)
		return true
	case r.Context().Err() != nil:
		s.fail(x.Pool, x.ID, "client_gone", start)
		return true
	case ownLimit(err):
		s.limited(w, x, err, start)
		return true
	}
	if cerr := originCertError(err); cerr != nil {
		// The origin's certificate failed verification: the origin's
		// doing (or the path's), the same through any proxy. No other
		// proxy is tried and none is blamed.
		s.fail(x.Pool, x.ID, "origin_tls", start)
		http.Error(w, fmt.Sprintf("proxyfleet gateway: origin certificate for host %s: %v", r.URL.Hostname(), cerr), http.StatusBadGateway)
		return true
	}
	s.suspect(x, "gateway: "+err.Error())
	s.fail(x.Pool, x.ID, "proxy_unreachable", start)
	if !last {
		return false
	}
	http.Error(w, fmt.Sprintf("proxyfleet gateway: proxy %s failed: %v", x.ID, err), http.StatusBadGateway)
	return true
}

// limited answers a request the gateway could not carry for want of its
// own resources.
func (s *Server) limited(w http.ResponseWriter, x route.Proxy, err error, start time.Time) {
	s.cfg.Log.Error("the gateway is out of descriptors or local ports; raise its open-file limit (LimitNOFILE): each tunnel holds 6", "proxy", x.ID, "err", err)
	s.fail(x.Pool, x.ID, "gateway_limit", start)
	http.Error(w, "proxyfleet gateway: the gateway is at its own limit ("+err.Error()+"); try again later", http.StatusServiceUnavailable)
}

// stalled answers a request whose body stopped arriving.
func (s *Server) stalled(w http.ResponseWriter, pool string, start time.Time) {
	s.fail(pool, "", "body_timeout", start)
	w.Header().Set("Connection", "close")
	http.Error(w, fmt.Sprintf("proxyfleet gateway: no byte of the request body arrived for %s; send it without pauses that long", s.cfg.BodyTimeout), http.StatusRequestTimeout)
}

// suspect has new connections avoid x for a while and, once per such
// period, reports it to health, without waiting.
func (s *Server) suspect(x route.Proxy, reason string) {
	if !s.cfg.Table.Cool(x.ID, s.cfg.Cooldown) {
		return
	}
	s.cfg.Log.Warn("proxy failed a request; avoiding it while health probes it", "proxy", x.ID, "pool", x.Pool, "reason", reason, "for", s.cfg.Cooldown.String())
	s.cfg.Fleet.Suspect(x.ID, reason)
}

// fail counts a request (or attempt) that carried nothing.
func (s *Server) fail(pool, proxy, kind string, start time.Time) {
	s.stats.failed(pool, proxy, kind, time.Since(start))
}

// tunnel opens a CONNECT tunnel through a proxy of target's pool, trying
// others when the proxy cannot be reached or answers 502, 503 or 504.
func (s *Server) tunnel(w http.ResponseWriter, r *http.Request, target route.Target) {
	start := time.Now()
	if _, port, err := net.SplitHostPort(r.Host); err != nil || port == "" {
		http.Error(w, fmt.Sprintf("proxyfleet gateway: CONNECT %q: want host:port", r.Host), http.StatusBadRequest)
		return
	}
	if s.intercepts(target.Pool) {
		s.intercept(w, r, target)
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		http.Error(w, "proxyfleet gateway: this connection cannot carry a tunnel", http.StatusInternalServerError)
		return
	}
	siteKey := site.Key(r.Host)
	tiers := s.tiers(target, siteKey)
	for i, pool := range tiers {
		tier := target
		tier.Pool = pool
		lastTier := i == len(tiers)-1
		retries := s.cfg.Table.Spec(pool).RetriesOrDefault()
		if s.tryProxies(r.Context(), w, tier, siteKey, retries, lastTier, start, func(x route.Proxy, last bool) bool {
			return s.tunnelOnce(w, hj, r, x, last, start, func() { s.served(target, siteKey, x.Pool, tiers[0]) })
		}, nil) {
			return
		}
	}
}

// tunnelOnce makes one attempt at a tunnel through x; it returns false
// when another may be made. opened is called once the tunnel is open.
func (s *Server) tunnelOnce(w http.ResponseWriter, hj http.Hijacker, r *http.Request, x route.Proxy, last bool, start time.Time, opened func()) bool {
	var auth string
	user, pw, err := s.cfg.Fleet.Credentials(x)
	if err != nil {
		s.fail(x.Pool, x.ID, "no_credentials", start)
		http.Error(w, "proxyfleet gateway: pool "+x.Pool+": "+err.Error(), http.StatusServiceUnavailable)
		return true
	}
	if user != "" {
		auth = "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pw))
	}
	up, br, resp, err := s.connect(r.Context(), x, r.Host, auth)
	if err != nil {
		return s.unreachable(w, r, x, err, last, start)
	}
	if resp.StatusCode != http.StatusOK {
		_ = up.Close()
		return s.connectRefused(w, x, resp, last, start)
	}
	client, crw, err := hj.Hijack()
	if err != nil {
		_ = up.Close()
		s.fail(x.Pool, x.ID, "client_gone", start)
		return true
	}
	_, err = io.WriteString(client, "HTTP/1.1 200 Connection established\r\n"+ProxyHeader+": "+x.ID+"\r\n"+PoolHeader+": "+x.Pool+"\r\n\r\n")
	if err == nil && br.Buffered() > 0 {
		b, _ := br.Peek(br.Buffered())
		_, err = client.Write(b)
	}
	var upN int64
	if err == nil && crw.Reader.Buffered() > 0 {
		b, _ := crw.Reader.Peek(crw.Reader.Buffered())
		var n int
		n, err = up.Write(b)
		upN += int64(n)
	}
	if err != nil {
		_ = client.Close()
		_ = up.Close()
		s.fail(x.Pool, x.ID, "client_gone", start)
		return true
	}
	opened()
	// A tunnel closed for idleness ends as any other: the client left it
	// unused.
	sent, received, _ := idle.Tunnel(client, up, s.cfg.TunnelIdleTimeout, false)
	s.stats.done(x, "ok", upN+sent, received, time.Since(start))
	reqlog.Tunneled(w, upN+sent, received)
	return true
}

// connectRefused handles a proxy's answer other than 200 to a CONNECT (a
// tunnel's, or the one the transport sent for an https:// request): a
// 502, 503 or 504 is the proxy's failure and another proxy may be tried;
// any other answer (its egress policy refusing the target, its ACL) is
// relayed once, no proxy blamed. It returns false when another proxy may
// be tried.
func (s *Server) connectRefused(w http.ResponseWriter, x route.Proxy, resp *http.Response, last bool, start time.Time) bool {
	if retryable(resp.StatusCode) && !last {
		s.suspect(x, fmt.Sprintf("gateway: the proxy answered CONNECT with %d", resp.StatusCode))
		s.fail(x.Pool, x.ID, "proxy_status", start)
		return false
	}
	// The client learns the status and the rule of an egress refusal,
	// not the proxy's credentials.
	s.fail(x.Pool, x.ID, "proxy_status", start)
	w.Header().Set(ProxyHeader, x.ID)
	w.Header().Set(PoolHeader, x.Pool)
	if rule := resp.Header.Get(egress.Header); rule != "" {
		w.Header().Set(egress.Header, rule)
	}
	http.Error(w, fmt.Sprintf("proxyfleet gateway: proxy %s answered CONNECT with %s", x.ID, resp.Status), resp.StatusCode)
	return true
}

// connect dials proxy x and asks it for a tunnel to host. On success the
// returned reader holds what the proxy sent past its answer.
func (s *Server) connect(ctx context.Context, x route.Proxy, host, auth string) (net.Conn, *bufio.Reader, *http.Response, error) {
	d := net.Dialer{Timeout: s.cfg.DialTimeout, KeepAlive: 30 * time.Second}
	up, err := d.DialContext(ctx, "tcp", x.Address)
	if err != nil {
		return nil, nil, nil, err
	}
	_ = up.SetDeadline(time.Now().Add(s.cfg.DialTimeout))
	req := "CONNECT " + host + " HTTP/1.1\r\nHost: " + host + "\r\n"
	if auth != "" {
		req += "Proxy-Authorization: " + auth + "\r\n"
	}
	if _, err := io.WriteString(up, req+"\r\n"); err != nil {
		_ = up.Close()
		return nil, nil, nil, err
	}
	br := bufio.NewReaderSize(up, 1024)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		_ = up.Close()
		return nil, nil, nil, fmt.Errorf("reading the answer to CONNECT: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		_ = resp.Body.Close()
	}
	_ = up.SetDeadline(time.Time{})
	return up, br, resp, nil
}
