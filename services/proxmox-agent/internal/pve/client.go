// Package pve is a small, hand-written client of exactly the Proxmox VE API
// endpoints the proxmox-agent uses. Every call takes ctx first; every error it
// returns is classified with the agent error classes (see [Classify]); every
// call that starts a task returns its UPID, and [Client.WaitTask] polls it to
// completion, putting a failed task's log into the error.
package pve

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/agent"
)

// Config says how to reach and authenticate to a Proxmox VE API.
type Config struct {
	// URL is the API base, e.g. https://192.168.0.8:8006 (the address the
	// node certificate names).
	URL string
	// TokenFile holds the API token as "user@realm!tokenid=secret".
	TokenFile string
	// CAFile is a PEM bundle the node certificate must chain to.
	CAFile string
	// Fingerprint is the pinned SHA-256 fingerprint of the node certificate
	// (hex, colons optional). With it, the certificate must match exactly.
	Fingerprint string
	// TaskPollInterval is how often a running task is polled (default 1s).
	TaskPollInterval time.Duration
	// RequestTimeout bounds one HTTP request (default 60s; uploads included).
	RequestTimeout time.Duration
	// Log gets one debug line per API call (route, status, duration; never
	// parameter values or bodies). Nil discards.
	Log *slog.Logger
	// Tracer makes one client span per API call. Nil means no tracing.
	Tracer trace.Tracer
}

// Client talks to one Proxmox VE cluster. It is safe for concurrent use.
type Client struct {
	base   *url.URL
	http   *http.Client
	auth   string
	poll   time.Duration
	log    *slog.Logger
	tracer trace.Tracer
	trace  func(method, path string, params url.Values)
}

// New builds a client from cfg: it reads the token file and sets up TLS
// verification. Verification is never disabled: with neither CAFile nor
// Fingerprint the system roots are used.
func New(cfg Config) (*Client, error) {
	base, err := url.Parse(strings.TrimRight(cfg.URL, "/"))
	if err != nil || base.Scheme != "https" || base.Host == "" {
		return nil, fmt.Errorf("API URL %q: must be https://host:port", cfg.URL)
	}
	raw, err := os.ReadFile(cfg.TokenFile)
	if err != nil {
		return nil, fmt.Errorf("token file: %w", err)
	}
	token, err := ParseToken(string(raw))
	if err != nil {
		return nil, fmt.Errorf("token file %s: %w", cfg.TokenFile, err)
	}
	tlsCfg, err := TLSConfig(cfg.CAFile, cfg.Fingerprint)
	if err != nil {
		return nil, err
	}
	timeout := cfg.RequestTimeout
	if timeout <= 0 {
		timeout = 60 * time.Second
	}
	poll := cfg.TaskPollInterval
	if poll <= 0 {
		poll = time.Second
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = tlsCfg
	tr.MaxIdleConnsPerHost = 16
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tracer := cfg.Tracer
	if tracer == nil {
		tracer = noop.NewTracerProvider().Tracer("")
	}
	return &Client{
		base:   base,
		http:   &http.Client{Transport: tr, Timeout: timeout},
		auth:   "PVEAPIToken=" + token,
		poll:   poll,
		log:    log,
		tracer: tracer,
	}, nil
}

// ParseToken checks an API token "user@realm!tokenid=secret" (an optional
// "PVEAPIToken=" prefix and surrounding white space are dropped) and
// returns it without the prefix.
func ParseToken(s string) (string, error) {
	s = strings.TrimSpace(s)
	s = strings.TrimPrefix(s, "PVEAPIToken=")
	at, bang, eq := strings.Index(s, "@"), strings.Index(s, "!"), strings.Index(s, "=")
	if at < 1 || bang < at+2 || eq < bang+2 || eq == len(s)-1 || strings.ContainsAny(s, " \t\r\n") {
		return "", errors.New("want one line user@realm!tokenid=secret")
	}
	return s, nil
}

// ErrFingerprintMismatch is returned (wrapped) when the server certificate
// does not match the pinned fingerprint.
var ErrFingerprintMismatch = errors.New("server certificate does not match the pinned SHA-256 fingerprint")

// TLSConfig returns the client TLS configuration: verification against the
// CA bundle in caFile, or against a pinned SHA-256 certificate fingerprint,
// or (neither given) against the system roots.
func TLSConfig(caFile, fingerprint string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("CA file %s: no PEM certificate in it", caFile)
		}
		cfg.RootCAs = pool
	}
	if fingerprint != "" {
		want, err := ParseFingerprint(fingerprint)
		if err != nil {
			return nil, err
		}
		// The pin replaces chain verification (a Proxmox node certificate is
		// usually signed by the cluster's own CA); the certificate must be
		// exactly the pinned one, so verification is not skipped but
		// replaced by a stricter check.
		cfg.InsecureSkipVerify = true
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return fmt.Errorf("%w: the server sent no certificate", ErrFingerprintMismatch)
			}
			sum := sha256.Sum256(cs.PeerCertificates[0].Raw)
			if !bytes.Equal(sum[:], want) {
				return fmt.Errorf("%w: got %s, pinned %s", ErrFingerprintMismatch, FormatFingerprint(sum[:]), FormatFingerprint(want))
			}
			return nil
		}
	}
	return cfg, nil
}

// ParseFingerprint parses a SHA-256 fingerprint written as 64 hex digits,
// with or without colons.
func ParseFingerprint(s string) ([]byte, error) {
	b, err := hex.DecodeString(strings.ReplaceAll(strings.TrimSpace(s), ":", ""))
	if err != nil || len(b) != sha256.Size {
		return nil, fmt.Errorf("fingerprint %q: want the SHA-256 of the certificate as 64 hex digits (colons optional)", s)
	}
	return b, nil
}

// FormatFingerprint writes a fingerprint as upper-case hex pairs joined by
// colons, the way Proxmox VE shows it.
func FormatFingerprint(b []byte) string {
	h := strings.ToUpper(hex.EncodeToString(b))
	parts := make([]string, 0, len(b))
	for i := 0; i < len(h); i += 2 {
		parts = append(parts, h[i:i+2])
	}
	return strings.Join(parts, ":")
}

// SetTrace installs fn, called with every request's method, API path and
// parameter names before it is sent (never values: they may be secrets).
// It is meant for tests and must be set before the client is used.
func (c *Client) SetTrace(fn func(method, path string, params url.Values)) { c.trace = fn }

// do sends one request to the API path p (below /api2/json) and decodes
// the "data" member of the answer into out (when out is not nil).
func (c *Client) do(ctx context.Context, method, p string, params url.Values, out any) error {
	var body io.Reader
	u := c.url(p)
	ctype := ""
	if method == http.MethodGet || method == http.MethodDelete {
		u.RawQuery = params.Encode()
	} else if params != nil {
		body = strings.NewReader(params.Encode())
		ctype = "application/x-www-form-urlencoded"
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return agent.Wrap(agent.ErrPermanent, err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	return c.send(req, method+" "+p, params, out)
}

// url returns the URL of the API path p, whose segments are already
// escaped (a volume id carries a '/', sent as %2F).
func (c *Client) url(p string) url.URL {
	u := *c.base
	u.RawPath = "/api2/json" + p
	u.Path, _ = url.PathUnescape(u.RawPath)
	return u
}

func (c *Client) send(req *http.Request, op string, params url.Values, out any) error {
	path := strings.TrimPrefix(req.URL.EscapedPath(), "/api2/json")
	if c.trace != nil {
		c.trace(req.Method, path, params)
	}
	route := Route(path)
	ctx, span := c.tracer.Start(req.Context(), "pve "+req.Method+" "+route, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("http.request.method", req.Method), attribute.String("url.path", path)))
	defer span.End()
	req = req.WithContext(ctx)
	start := time.Now()
	status := 0
	var err error
	defer func() {
		span.SetAttributes(attribute.Int("http.response.status_code", status))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, "pve call failed")
		}
		c.log.Debug("pve call", "method", req.Method, "route", route, "path", path, "status", status,
			"duration_ms", time.Since(start).Milliseconds(), "err", err)
	}()
	err = c.roundTrip(req, op, &status, out)
	return err
}

func (c *Client) roundTrip(req *http.Request, op string, status *int, out any) error {
	req.Header.Set("Authorization", c.auth)
	req.Header.Set("Accept", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		if errors.Is(err, ErrFingerprintMismatch) {
			return agent.Wrap(agent.ErrPermanent, fmt.Errorf("%s: %w", op, err))
		}
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: %w", op, err))
	}
	defer resp.Body.Close()
	*status = resp.StatusCode
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: read answer: %w", op, err))
	}
	if resp.StatusCode >= 400 {
		return Classify(parseError(op, resp, raw))
	}
	if out == nil {
		return nil
	}
	var env struct {
		Data json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(raw, &env); err != nil {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: undecodable answer: %w", op, err))
	}
	if len(env.Data) == 0 || string(env.Data) == "null" {
		return nil
	}
	if err := json.Unmarshal(env.Data, out); err != nil {
		return agent.Wrap(agent.ErrPermanent, fmt.Errorf("%s: unexpected answer: %w", op, err))
	}
	return nil
}

// routeParams names the path segment that follows each fixed segment.
var routeParams = map[string]string{"nodes": "{node}", "qemu": "{vmid}", "storage": "{storage}", "content": "{volume}", "tasks": "{upid}"}

// Route returns the schema path of an API path, e.g.
// "/nodes/{node}/qemu/{vmid}/config" for "/nodes/pve1/qemu/105/config":
// a low-cardinality name for spans and logs.
func Route(path string) string {
	segs := strings.Split(path, "/")
	for i := 1; i < len(segs); i++ {
		if p, ok := routeParams[segs[i-1]]; ok && segs[i] != "" {
			segs[i] = p
			i++
		}
	}
	return strings.Join(segs, "/")
}

// APIError is an HTTP error answer of the API.
type APIError struct {
	Op     string // "POST /nodes/pve1/qemu/9000/clone"
	Status int
	// Reason is the HTTP reason phrase; Proxmox VE puts the first line of
	// the message there.
	Reason string
	// Message is the "message" member, trimmed.
	Message string
	// Errors holds per-parameter problems of a 400 answer.
	Errors map[string]string
}

func (e *APIError) Error() string {
	msg := e.Message
	if msg == "" {
		msg = e.Reason
	}
	s := fmt.Sprintf("%s: %d %s", e.Op, e.Status, msg)
	if len(e.Errors) > 0 {
		keys := make([]string, 0, len(e.Errors))
		for k := range e.Errors {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			s += fmt.Sprintf("; %s: %s", k, strings.TrimSpace(e.Errors[k]))
		}
	}
	return s
}

func parseError(op string, resp *http.Response, raw []byte) *APIError {
	e := &APIError{Op: op, Status: resp.StatusCode}
	e.Reason = strings.TrimSpace(strings.TrimPrefix(resp.Status, strconv.Itoa(resp.StatusCode)))
	var body struct {
		Message string            `json:"message"`
		Errors  map[string]string `json:"errors"`
	}
	if json.Unmarshal(raw, &body) == nil {
		e.Message = strings.TrimSpace(body.Message)
		e.Errors = body.Errors
	}
	if e.Message == "" {
		e.Message = e.Reason
	}
	return e
}
