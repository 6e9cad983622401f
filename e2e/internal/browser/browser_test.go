//go:build console

package browser_test

import (
	"bytes"
	"context"
	"fmt"
	"image/png"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"proxyfleet/e2e/internal/browser"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// csp is the console's Content-Security-Policy, so the harness is proven
// under the policy the console's pages run with.
const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

func startBrowser(t *testing.T) *browser.Browser {
	t.Helper()
	exe, err := browser.Find()
	testgate.Need(t, err == nil, fmt.Sprint(err))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	var out bytes.Buffer
	b, err := browser.Start(ctx, browser.Options{Exe: exe, Output: &out})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Error(err)
		}
	})
	return b
}

// site serves pages under the console's headers (those under /open/
// without its Content-Security-Policy): each path of pages is an HTML
// body; /app.js fills #out.
func site(t *testing.T, pages map[string]string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/app.js" {
			w.Header().Set("Content-Type", "text/javascript")
			io.WriteString(w, `document.getElementById('out').textContent = 'scripted ' + location.pathname;`)
			return
		}
		body, ok := pages[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		if !strings.HasPrefix(r.URL.Path, "/open/") {
			w.Header().Set("Content-Security-Policy", csp)
		}
		w.Header().Set("Server-Timing", "render;dur=12.5")
		fmt.Fprintf(w, `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>harness</title></head><body><main>%s</main></body></html>`, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestBrowserLoopbackPage(t *testing.T) {
	b := startBrowser(t)
	srv := site(t, map[string]string{
		"/":       `<h1>Harness</h1><p id="out">static</p><script src="/app.js"></script>`,
		"/inline": `<h1>Inline</h1><p id="out">static</p><script>document.getElementById('out').textContent = 'inline ran';</script>`,
	})
	tab, cancel := b.NewTab()
	defer cancel()
	problems := browser.WatchProblems(tab)
	if err := chromedp.Do(tab, chromedp.Navigate(srv.URL+"/")); err != nil {
		t.Fatal(err)
	}
	// The page's own script ran under the strict policy.
	if err := chromedp.Do(tab, chromedp.WaitVisible(chromedp.CSS("#out"))); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "app.js to fill #out", func() bool {
		text, err := chromedp.Run(tab, chromedp.Text(chromedp.CSS("#out")))
		return err == nil && text == "scripted /"
	})

	timing, err := browser.ServerTiming(tab)
	if err != nil {
		t.Fatal(err)
	}
	if timing["render"] != 12.5 {
		t.Errorf("Server-Timing render = %v, want 12.5 (header render;dur=12.5)", timing)
	}

	mem, err := browser.MeasureMemory(tab)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("harness page: %v", mem)
	if mem.HeapUsed <= 0 || mem.HeapTotal < mem.HeapUsed || mem.Nodes < 5 || mem.Documents < 1 {
		t.Errorf("implausible memory reading: %+v", mem)
	}

	shot, err := browser.Screenshot(tab)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(shot))
	if err != nil {
		t.Fatalf("screenshot is not a PNG: %v", err)
	}
	if w := img.Bounds().Dx(); w != 1280 {
		t.Errorf("screenshot is %d pixels wide, want the window's 1280", w)
	}
	if p := problems.List(); len(p) != 0 {
		t.Errorf("the page reported errors: %q", p)
	}

	// An inline script breaks the policy: it does not run, and the
	// violation is among the problems, so a console page that relied on
	// one would fail its test.
	if err := chromedp.Do(tab, chromedp.Navigate(srv.URL+"/inline")); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "the policy violation to be reported", func() bool {
		for _, p := range problems.List() {
			if strings.Contains(p, "Content Security Policy") {
				return true
			}
		}
		return false
	})
	if text, err := chromedp.Run(tab, chromedp.Text(chromedp.CSS("#out"))); err != nil || text != "static" {
		t.Errorf("#out = %q, %v: the inline script ran despite the policy", text, err)
	}
	if o := problems.Outside(); len(o) != 0 {
		t.Errorf("loopback pages requested %q outside", o)
	}
	// What the guard refused was the browser's own (its update and
	// account hosts), never the pages'.
	t.Logf("the guard refused the browser's own requests for %v", b.Refused())
}

// TestBrowserReachesLoopbackOnly proves the guard: a page's subresources,
// a navigation and a fetch naming hosts outside loopback (by name and by
// address, HTTP and HTTPS) all end at the guard, which refuses them, and
// the page never gets their content.
func TestBrowserReachesLoopbackOnly(t *testing.T) {
	b := startBrowser(t)
	// Without the console's policy, which would stop these before the
	// network.
	srv := site(t, map[string]string{
		"/open/": `<h1>Outside</h1><p id="out">static</p>` +
			`<img alt="outside" src="http://192.0.2.1/pixel.png">` +
			`<img alt="outside by name" src="https://assets.example.net/logo.png">`,
	})
	tab, cancel := b.NewTab()
	defer cancel()
	problems := browser.WatchProblems(tab)
	if err := chromedp.Do(tab, chromedp.Navigate(srv.URL+"/open/")); err != nil {
		t.Fatal(err)
	}
	// A fetch from the page.
	if err := chromedp.Do(tab, chromedp.Evaluate[chromedp.Void](`fetch('http://203.0.113.9:8080/api').catch(() => {})`)); err != nil {
		t.Fatal(err)
	}
	// A navigation outside: plain HTTP gets the guard's refusal as its
	// page; HTTPS fails to tunnel.
	if err := chromedp.Do(tab, chromedp.Navigate("http://outside.example/")); err != nil {
		t.Logf("navigation outside: %v", err)
	}
	body, err := chromedp.Run(tab, chromedp.Evaluate[string](`document.body ? document.body.innerText : ''`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(body, "reaches loopback only") {
		t.Errorf("the page of http://outside.example/ is %q, not the guard's refusal", body)
	}
	if err := chromedp.Do(tab, chromedp.Navigate("https://198.51.100.7/")); err == nil {
		t.Errorf("an HTTPS navigation outside loaded a page")
	}
	// A tab in a browser context of its own goes through the guard too.
	session, cancelSession := b.NewSession()
	defer cancelSession()
	if err := chromedp.Do(session, chromedp.Navigate("http://second.example/")); err != nil {
		t.Logf("navigation outside from a second session: %v", err)
	}
	want := []string{"192.0.2.1:80", "assets.example.net:443", "203.0.113.9:8080", "outside.example:80", "198.51.100.7:443", "second.example:80"}
	ctx, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel2()
	if err := testwait.For(ctx, func() bool {
		got := b.Refused()
		for _, h := range want {
			if !slices.Contains(got, h) {
				return false
			}
		}
		return true
	}); err != nil {
		t.Fatalf("the guard refused %v, want at least %v", b.Refused(), want)
	}
	// The tab's watcher saw them too: a console page's test fails on any.
	if o := problems.Outside(); len(o) < 4 {
		t.Errorf("the tab's outside requests: %q, want the images, the fetch and the navigations", o)
	}
	t.Logf("refused: %v", b.Refused())
}

// TestBrowserAxe runs axe-core in pages under the strict policy: it finds
// an image without a text alternative and an unnamed button (critical),
// and nothing serious in a plain page.
func TestBrowserAxe(t *testing.T) {
	axe, err := browser.ReadAxe()
	testgate.Need(t, err == nil, fmt.Sprint(err))
	b := startBrowser(t)
	srv := site(t, map[string]string{
		"/bad":  `<h1>Bad</h1><p id="out">x</p><img src="/nothing.png"><button></button>`,
		"/good": `<h1>Good</h1><p id="out">x</p><img alt="a pixel" src="/nothing.png"><button>Recycle</button>`,
	})
	tab, cancel := b.NewTab()
	defer cancel()
	for path, want := range map[string][]string{"/bad": {"image-alt", "button-name"}, "/good": nil} {
		if err := chromedp.Do(tab, chromedp.Navigate(srv.URL+path)); err != nil {
			t.Fatal(err)
		}
		vs, err := browser.Axe(tab, axe)
		if err != nil {
			t.Fatal(err)
		}
		var severe []string
		for _, v := range vs {
			t.Logf("%s: %v", path, v)
			if v.Severe() {
				severe = append(severe, v.ID)
			}
		}
		slices.Sort(severe)
		slices.Sort(want)
		if !slices.Equal(severe, want) {
			t.Errorf("%s: serious or critical violations %v, want %v", path, severe, want)
		}
	}
}
