// Package browser runs Debian's Chromium headless for the console's browser
// tests (make test-console) and its screenshots (make pictures), driven
// over the DevTools protocol with chromedp.
//
// The browser reaches loopback only. It starts with the flags that keep it
// from calling home (no background networking, component updates, sync or
// QUIC) and with every request for a host outside loopback sent to a guard:
// an HTTP proxy in this process, on 127.0.0.1, that refuses each request
// and records its host ([Browser.Refused]). Loopback bypasses the proxy;
// names other than localhost resolve to nothing. So a page that names an
// outside host (a font, a script, a link followed) gets a refusal and the
// test sees the attempt, and nothing leaves the machine.
//
//	b, err := browser.Start(ctx, browser.Options{Exe: "/usr/bin/chromium"})
//	if err != nil { ... }
//	defer b.Close()
//	tab, cancel := b.NewTab()
//	defer cancel()
//	err = chromedp.Do(tab, chromedp.Navigate(url))
package browser

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"sync"
	"time"

	"github.com/chromedp/chromedp"
)

// EnvChromium names the Chromium binary (default: chromium on PATH).
const EnvChromium = "PROXYFLEET_CHROMIUM"

// Find returns the Chromium binary: $PROXYFLEET_CHROMIUM, or chromium on
// PATH.
func Find() (string, error) {
	if p := os.Getenv(EnvChromium); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s=%s: %w", EnvChromium, p, err)
		}
		return p, nil
	}
	p, err := exec.LookPath("chromium")
	if err != nil {
		return "", fmt.Errorf("chromium not found on PATH (install Debian's chromium: make chromium-install): %w", err)
	}
	return p, nil
}

// Options configure [Start].
type Options struct {
	Exe    string    // the Chromium binary; empty: [Find]
	Width  int       // the window's width in CSS pixels (default 1280)
	Height int       // the window's height (default 900)
	Output io.Writer // Chromium's own stdout and stderr; nil: discarded
}

// Browser is one headless Chromium with a profile of its own (removed by
// Close) and the loopback guard.
type Browser struct {
	dataDir     string
	guard       *guard
	allocCancel context.CancelFunc
	ctx         context.Context // the first tab: holds the browser
	cancel      context.CancelFunc
}

// Start launches Chromium and opens its first tab. ctx bounds the
// browser's whole life.
func Start(ctx context.Context, opts Options) (*Browser, error) {
	if opts.Exe == "" {
		exe, err := Find()
		if err != nil {
			return nil, err
		}
		opts.Exe = exe
	}
	if opts.Width == 0 {
		opts.Width = 1280
	}
	if opts.Height == 0 {
		opts.Height = 900
	}
	dataDir, err := os.MkdirTemp("", "proxyfleet-chromium-")
	if err != nil {
		return nil, fmt.Errorf("chromium profile directory: %w", err)
	}
	g, err := startGuard()
	if err != nil {
		os.RemoveAll(dataDir)
		return nil, err
	}
	b := &Browser{dataDir: dataDir, guard: g}
	allocOpts := append(Flags(g.addr, dataDir),
		chromedp.ExecPath(opts.Exe),
		chromedp.WindowSize(opts.Width, opts.Height),
	)
	if opts.Output != nil {
		allocOpts = append(allocOpts, chromedp.CombinedOutput(opts.Output))
	}
	allocCtx, allocCancel := chromedp.NewExecAllocator(ctx, allocOpts...)
	b.allocCancel = allocCancel
	b.ctx, b.cancel = chromedp.NewContext(allocCtx)
	if err := chromedp.Do(b.ctx); err != nil {
		b.Close()
		return nil, fmt.Errorf("start chromium %s: %w", opts.Exe, err)
	}
	return b, nil
}

// Flags are the allocator options every browser of the package starts
// with: headless, no sandbox (the tests run as root), no GPU, and nothing
// that reaches out on its own — no QUIC, no background networking,
// component updates, sync, first-run or default-browser checks — plus the
// guard: every request outside loopback goes to the proxy at guardAddr, and
// names other than localhost resolve to nothing. dataDir is a fresh
// profile.
func Flags(guardAddr, dataDir string) []chromedp.ExecAllocatorOption {
	return []chromedp.ExecAllocatorOption{
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(dataDir),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-breakpad", true),
		chromedp.Flag("disable-client-side-phishing-detection", true),
		chromedp.Flag("disable-domain-reliability", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-features", "Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider,InterestFeedContentSuggestions"),
		chromedp.Flag("no-pings", true),
		chromedp.Flag("metrics-recording-only", true),
		chromedp.Flag("safebrowsing-disable-auto-update", true),
		chromedp.Flag("password-store", "basic"),
		chromedp.Flag("use-mock-keychain", true),
		chromedp.Flag("force-webrtc-ip-handling-policy", "disable_non_proxied_udp"),
		chromedp.Flag("proxy-server", "http://"+guardAddr),
		chromedp.Flag("proxy-bypass-list", "127.0.0.1;localhost;[::1]"),
		chromedp.Flag("host-resolver-rules", "MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"),
	}
}

// Context is the browser's first tab, for chromedp.Do and chromedp.Run.
func (b *Browser) Context() context.Context { return b.ctx }

// NewTab opens another tab of the browser; cancel closes it.
func (b *Browser) NewTab() (context.Context, context.CancelFunc) {
	return chromedp.NewContext(b.ctx)
}

// NewSession opens a tab in a browser context of its own: its cookies and
// storage are its own, as a second visitor's would be; cancel closes it.
func (b *Browser) NewSession() (context.Context, context.CancelFunc) {
	return chromedp.NewContext(b.ctx, chromedp.WithNewBrowserContext())
}

// Refused lists the hosts (host:port) outside loopback the browser tried
// to reach since it started, in order, each once.
func (b *Browser) Refused() []string { return b.guard.refused() }

// Close ends the browser, waits for it, and removes its profile.
func (b *Browser) Close() error {
	if b.cancel != nil {
		b.cancel()
	}
	if b.allocCancel != nil {
		b.allocCancel()
	}
	b.guard.close()
	// Chromium's helpers may still write into the profile for a moment.
	var err error
	for range 50 {
		if err = os.RemoveAll(b.dataDir); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("remove chromium profile %s: %w", b.dataDir, err)
}

// guard is the browser's proxy: it refuses every request and CONNECT with
// 403 and records the host asked for. It never dials anything.
type guard struct {
	addr string
	srv  *http.Server

	mu    sync.Mutex
	hosts []string
}

func startGuard() (*guard, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("browser guard proxy: %w", err)
	}
	g := &guard{addr: ln.Addr().String()}
	g.srv = &http.Server{Handler: http.HandlerFunc(g.refuse), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := g.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(os.Stderr, "browser guard proxy: %v\n", err)
		}
	}()
	return g, nil
}

func (g *guard) refuse(w http.ResponseWriter, r *http.Request) {
	host := r.Host
	if host == "" && r.URL != nil {
		host = r.URL.Host
	}
	if _, _, err := net.SplitHostPort(host); err != nil {
		port := "80"
		if r.Method == http.MethodConnect || (r.URL != nil && r.URL.Scheme == "https") {
			port = "443"
		}
		host = net.JoinHostPort(host, port)
	}
	g.mu.Lock()
	if !slices.Contains(g.hosts, host) {
		g.hosts = append(g.hosts, host)
	}
	g.mu.Unlock()
	http.Error(w, "the test browser reaches loopback only: "+host+" refused", http.StatusForbidden)
}

func (g *guard) refused() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.hosts)
}

func (g *guard) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = g.srv.Shutdown(ctx)
}
