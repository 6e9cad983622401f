package probe

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"
)

// Credentials are the basic-auth pair a proxy demands. Password is a
// secret: it is sent to the proxy and nowhere else.
type Credentials struct {
	Username string
	Password string
}

func (c *Credentials) header() string {
	if c == nil || c.Username == "" {
		return ""
	}
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(c.Username+":"+c.Password))
}

// Result is the outcome of checking one proxy.
type Result struct {
	// HTTP is the error of the plain HTTP GET through the proxy, nil when it
	// succeeded; Connect that of the GET through a CONNECT tunnel.
	HTTP, Connect error
	// HTTPLatency and ConnectLatency are the durations of the two checks.
	HTTPLatency, ConnectLatency time.Duration
	// EgressIP is the address the echo endpoint saw.
	EgressIP string
}

// OK reports whether both checks passed.
func (r Result) OK() bool { return r.HTTP == nil && r.Connect == nil }

// Err returns the first failure, or nil.
func (r Result) Err() error {
	if r.HTTP != nil {
		return fmt.Errorf("http: %w", r.HTTP)
	}
	if r.Connect != nil {
		return fmt.Errorf("connect: %w", r.Connect)
	}
	return nil
}

// Check sends two requests for echo through the proxy at addr (host:port),
// each bounded by timeout: a plain proxied GET, and a GET through a CONNECT
// tunnel (over TLS when echo is https). With creds, both carry
// Proxy-Authorization.
func Check(ctx context.Context, addr string, creds *Credentials, echo *url.URL, timeout time.Duration) Result {
	var r Result
	start := time.Now()
	ipHTTP, err := checkHTTP(ctx, addr, creds, echo, timeout)
	r.HTTP, r.HTTPLatency = err, time.Since(start)
	start = time.Now()
	ipConnect, err := checkConnect(ctx, addr, creds, echo, timeout)
	r.Connect, r.ConnectLatency = err, time.Since(start)
	r.EgressIP = ipHTTP
	if r.EgressIP == "" {
		r.EgressIP = ipConnect
	}
	return r
}

// checkHTTP sends a GET for echo to the proxy at addr on a connection of
// its own. An http echo is asked for in the proxy's absolute-URI form on a
// bare connection; an https one goes through the proxy as a client would
// send it, in a CONNECT tunnel.
func checkHTTP(ctx context.Context, addr string, creds *Credentials, echo *url.URL, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if echo.Scheme == "https" {
		return checkHTTPSTransport(ctx, addr, creds, echo, timeout)
	}
	conn, stop, err := dialBound(ctx, addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	defer stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, echo.String(), nil)
	if err != nil {
		return "", err
	}
	req.Close = true
	if h := creds.header(); h != "" {
		req.Header.Set("Proxy-Authorization", h)
	}
	if err := req.WriteProxy(conn); err != nil {
		return "", fmt.Errorf("send GET: %w", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		return "", fmt.Errorf("read GET answer: %w", err)
	}
	defer resp.Body.Close()
	return readEcho(resp)
}

func checkHTTPSTransport(ctx context.Context, addr string, creds *Credentials, echo *url.URL, timeout time.Duration) (string, error) {
	proxyURL := &url.URL{Scheme: "http", Host: addr}
	if creds != nil && creds.Username != "" {
		proxyURL.User = url.UserPassword(creds.Username, creds.Password)
	}
	tr := &http.Transport{
		Proxy:             http.ProxyURL(proxyURL),
		DialContext:       (&net.Dialer{Timeout: timeout, KeepAlive: -1}).DialContext,
		DisableKeepAlives: true,
		ForceAttemptHTTP2: false,
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, echo.String(), nil)
	if err != nil {
		return "", err
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		return "", cleanErr(err, proxyURL)
	}
	defer resp.Body.Close()
	return readEcho(resp)
}

// probeDialer dials the proxies. A check's connection lives for one
// request: TCP keep-alive, on by default, would only cost its system calls
// on every dial (about 5% of health's CPU probing 10,000 proxies).
var probeDialer = &net.Dialer{KeepAlive: -1}

// dialBound dials addr and binds the connection to ctx: ctx's deadline is
// the connection's, and the end of ctx unblocks a read or write at once.
// The caller closes conn and calls stop, which unbinds it.
func dialBound(ctx context.Context, addr string) (conn net.Conn, stop func() bool, err error) {
	conn, err = probeDialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	stop = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	return conn, stop, nil
}

func checkConnect(ctx context.Context, addr string, creds *Credentials, echo *url.URL, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, stop, err := dialBound(ctx, addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	defer stop()

	target := hostPort(echo)
	connectReq := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Opaque: target},
		Host:   target,
		Header: http.Header{},
	}
	if h := creds.header(); h != "" {
		connectReq.Header.Set("Proxy-Authorization", h)
	}
	if err := connectReq.Write(conn); err != nil {
		return "", fmt.Errorf("send CONNECT: %w", err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, connectReq)
	if err != nil {
		return "", fmt.Errorf("read CONNECT answer: %w", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", statusErr("CONNECT "+target, resp)
	}
	var tunnel io.ReadWriter = &bufferedConn{Conn: conn, r: br}
	if echo.Scheme == "https" {
		tc := tls.Client(&bufferedConn{Conn: conn, r: br}, &tls.Config{ServerName: echo.Hostname(), MinVersion: tls.VersionTLS12})
		if err := tc.HandshakeContext(ctx); err != nil {
			return "", fmt.Errorf("TLS through the tunnel: %w", err)
		}
		tunnel = tc
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, echo.String(), nil)
	if err != nil {
		return "", err
	}
	req.Close = true
	if err := req.Write(tunnel); err != nil {
		return "", fmt.Errorf("send GET through the tunnel: %w", err)
	}
	resp, err = http.ReadResponse(bufio.NewReader(tunnel), req)
	if err != nil {
		return "", fmt.Errorf("read GET answer through the tunnel: %w", err)
	}
	defer resp.Body.Close()
	return readEcho(resp)
}

// bufferedConn reads through the reader that parsed the CONNECT answer, so
// no byte the proxy sent after it is lost.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func hostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	if u.Scheme == "https" {
		return net.JoinHostPort(u.Hostname(), "443")
	}
	return net.JoinHostPort(u.Hostname(), "80")
}

// readEcho reads the echo's answer: JSON with an "ip" field, or a plain-text
// address.
func readEcho(resp *http.Response) (string, error) {
	if resp.StatusCode != http.StatusOK {
		return "", statusErr("GET", resp)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return "", fmt.Errorf("read echo answer: %w", err)
	}
	return ParseEcho(body)
}

// ParseEcho extracts the IP from an echo answer: {"ip":"…"} or the bare
// address as text.
func ParseEcho(body []byte) (string, error) {
	s := strings.TrimSpace(string(body))
	if strings.HasPrefix(s, "{") {
		var v struct {
			IP string `json:"ip"`
		}
		if err := json.Unmarshal([]byte(s), &v); err != nil {
			return "", fmt.Errorf("echo answer is not the expected JSON: %w", err)
		}
		s = v.IP
	}
	ip, err := netip.ParseAddr(s)
	if err != nil {
		return "", fmt.Errorf("echo answer holds no IP address (%.40q)", s)
	}
	return ip.Unmap().String(), nil
}

func statusErr(what string, resp *http.Response) error {
	if resp.StatusCode == http.StatusProxyAuthRequired {
		return fmt.Errorf("%s: proxy demands authentication (%s)", what, resp.Status)
	}
	return fmt.Errorf("%s: answered %s", what, resp.Status)
}

// cleanErr keeps the proxy URL's credentials out of error text: url.Error
// prints the request URL, and some net errors print the proxy URL.
func cleanErr(err error, proxyURL *url.URL) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if proxyURL.User == nil {
		return err
	}
	if pw, ok := proxyURL.User.Password(); ok && pw != "" && strings.Contains(err.Error(), pw) {
		return errors.New(strings.ReplaceAll(err.Error(), pw, "xxxxx"))
	}
	return err
}
