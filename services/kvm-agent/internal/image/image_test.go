package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/libvirt/libvirtfake"
)

const pool = "default"

var img = []byte(strings.Repeat("qcow2-image-bytes;", 1000))

func digest(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// origin serves img, counting requests; failAt > 0 makes it die after
// failAt bytes of the body.
type origin struct {
	srv      *httptest.Server
	requests atomic.Int32
	failAt   atomic.Int32
	gate     chan struct{} // when set, the handler waits for it
}

func newOrigin(t *testing.T) *origin {
	o := &origin{}
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.requests.Add(1)
		if o.gate != nil {
			<-o.gate
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		if n := int(o.failAt.Load()); n > 0 {
			_, _ = w.Write(img[:n])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // the connection dies mid-body
		}
		_, _ = w.Write(img)
	}))
	t.Cleanup(o.srv.Close)
	return o
}

func newCache(f *libvirtfake.Fake, entry string, progress func(Progress)) *Cache {
	cfg := Config{Entry: entry, Pool: pool, TransferTimeout: 5 * time.Minute, ProgressEvery: time.Nanosecond}
	if progress != nil {
		cfg.OnProgress = func(_ context.Context, p Progress) { progress(p) }
	}
	return New(f, cfg, nil)
}

func TestFetchWritesBaseThenMarker(t *testing.T) {
	f := libvirtfake.New(pool)
	o := newOrigin(t)
	var mu sync.Mutex
	var reports []Progress
	c := newCache(f, "kvm-a", func(p Progress) { mu.Lock(); reports = append(reports, p); mu.Unlock() })
	base, err := c.Ensure(context.Background(), Source{Key: "deb", URL: o.srv.URL, SHA256: digest(img), Format: "qcow2"})
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	if base.Volume.Name != "base-kvm-a-deb.qcow2" || base.Path != "/pools/default/base-kvm-a-deb.qcow2" {
		t.Errorf("base = %+v", base)
	}
	got, _ := f.Volume(pool, "base-kvm-a-deb.qcow2")
	if string(got) != string(img) {
		t.Errorf("base content differs (%d bytes, want %d)", len(got), len(img))
	}
	m, ok := f.Volume(pool, "base-kvm-a-deb.qcow2.sha256")
	if !ok || string(m) != digest(img) {
		t.Errorf("marker = %q, want %q", m, digest(img))
	}
	mu.Lock()
	last := reports[len(reports)-1]
	mu.Unlock()
	if !last.Finished || last.Done != uint64(len(img)) || last.Total != uint64(len(img)) || last.Err != "" {
		t.Errorf("last progress = %+v", last)
	}
	// Cached: no second download.
	if _, err := c.Ensure(context.Background(), Source{Key: "deb", URL: o.srv.URL, SHA256: digest(img), Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	if n := o.requests.Load(); n != 1 {
		t.Errorf("downloads = %d, want 1", n)
	}
}

func TestCacheDecisions(t *testing.T) {
	src := func(url string) Source { return Source{Key: "deb", URL: url, Format: "qcow2"} }
	tests := []struct {
		name      string
		setup     func(f *libvirtfake.Fake)
		sha       string
		wantClass string // "" = success
		wantFetch bool
		wantBase  string // expected base content afterwards ("" = absent)
	}{
		{"nothing cached fetches", func(f *libvirtfake.Fake) {}, "", "", true, string(img)},
		{"base without marker is debris and is replaced", func(f *libvirtfake.Fake) {
			f.PutVolume(pool, "base-e-deb.qcow2", []byte("partial"))
		}, "", "", true, string(img)},
		{"marker that is not a digest is replaced", func(f *libvirtfake.Fake) {
			f.PutVolume(pool, "base-e-deb.qcow2", []byte("old"))
			f.PutVolume(pool, "base-e-deb.qcow2.sha256", []byte("garbage"))
		}, "", "", true, string(img)},
		{"verified base is used without a configured digest", func(f *libvirtfake.Fake) {
			f.PutVolume(pool, "base-e-deb.qcow2", []byte("old"))
			f.PutVolume(pool, "base-e-deb.qcow2.sha256", []byte(digest([]byte("old"))))
		}, "", "", false, "old"},
		{"digest mismatch on a verified base is permanent and keeps it", func(f *libvirtfake.Fake) {
			f.PutVolume(pool, "base-e-deb.qcow2", []byte("old"))
			f.PutVolume(pool, "base-e-deb.qcow2.sha256", []byte(digest([]byte("old"))))
		}, digest(img), agent.ClassPermanent, false, "old"},
		{"marker without base fetches", func(f *libvirtfake.Fake) {
			f.PutVolume(pool, "base-e-deb.qcow2.sha256", []byte(digest(img)))
		}, digest(img), "", true, string(img)},
		{"download with the wrong digest is discarded", func(f *libvirtfake.Fake) {}, digest([]byte("other")), agent.ClassPermanent, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := libvirtfake.New(pool)
			tc.setup(f)
			o := newOrigin(t)
			c := newCache(f, "e", nil)
			s := src(o.srv.URL)
			s.SHA256 = tc.sha
			_, err := c.Ensure(context.Background(), s)
			if got := agent.Classify(err); got != tc.wantClass {
				t.Fatalf("class = %q, want %q (err %v)", got, tc.wantClass, err)
			}
			if tc.wantClass == agent.ClassPermanent && tc.sha != "" && !tc.wantFetch && !strings.Contains(err.Error(), "add a new image key") {
				t.Errorf("error does not tell the operator what to do: %v", err)
			}
			if fetched := o.requests.Load() > 0; fetched != tc.wantFetch {
				t.Errorf("fetched = %v, want %v", fetched, tc.wantFetch)
			}
			got, ok := f.Volume(pool, "base-e-deb.qcow2")
			if tc.wantBase == "" {
				if ok {
					t.Errorf("base left behind (%d bytes)", len(got))
				}
				if _, ok := f.Volume(pool, "base-e-deb.qcow2.sha256"); ok {
					t.Error("marker written for a rejected download")
				}
			} else if string(got) != tc.wantBase {
				t.Errorf("base = %.20q…, want %.20q…", got, tc.wantBase)
			}
		})
	}
}

func TestFailedDownloadLeavesNoPartialBase(t *testing.T) {
	f := libvirtfake.New(pool)
	o := newOrigin(t)
	o.failAt.Store(int32(len(img) / 2))
	c := newCache(f, "e", nil)
	s := Source{Key: "deb", URL: o.srv.URL, Format: "qcow2"}
	_, err := c.Ensure(context.Background(), s)
	if !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("Ensure = %v, want transient", err)
	}
	if vols := f.Volumes(pool); len(vols) != 0 {
		t.Fatalf("volumes left after a failed download: %v", vols)
	}
	o.failAt.Store(0)
	if _, err := c.Ensure(context.Background(), s); err != nil {
		t.Fatalf("next attempt: %v", err)
	}
}

func TestConcurrentFetchesCoalesce(t *testing.T) {
	f := libvirtfake.New(pool)
	o := newOrigin(t)
	o.gate = make(chan struct{})
	c := newCache(f, "e", nil)
	s := Source{Key: "deb", URL: o.srv.URL, SHA256: digest(img), Format: "qcow2"}
	const n = 5
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() { _, err := c.Ensure(context.Background(), s); errs <- err }()
	}
	deadline := time.Now().Add(10 * time.Second)
	for o.requests.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(o.gate)
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Fatalf("Ensure: %v", err)
		}
	}
	if got := o.requests.Load(); got != 1 {
		t.Errorf("downloads = %d, want 1", got)
	}
	if got := f.Calls["virStorageVolCreateXML"]; got != 2 { // base + marker
		t.Errorf("volumes created = %d, want 2", got)
	}
}

func TestTwoEntriesDoNotShareABase(t *testing.T) {
	f := libvirtfake.New(pool)
	o := newOrigin(t)
	s := Source{Key: "deb", URL: o.srv.URL, Format: "qcow2"}
	a, err := newCache(f, "kvm-a", nil).Ensure(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	b, err := newCache(f, "kvm-b", nil).Ensure(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if a.Volume.Name == b.Volume.Name {
		t.Fatalf("both entries use %s", a.Volume.Name)
	}
	if n := o.requests.Load(); n != 2 {
		t.Errorf("downloads = %d, want 2 (one per entry)", n)
	}
}

func TestStalledDownloadEndsInsideTheTransferBudget(t *testing.T) {
	f := libvirtfake.New(pool)
	stalled := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		_, _ = w.Write(img[:100])
		w.(http.Flusher).Flush()
		close(stalled)
		<-r.Context().Done() // the mirror stalls until the client gives up
	}))
	defer srv.Close()
	// The download's deadline is one minute inside the transfer budget:
	// here 300ms, so the fetch ends through its reader, long before the budget.
	c := New(f, Config{Entry: "e", Pool: pool, TransferTimeout: time.Minute + 300*time.Millisecond}, nil)
	start := time.Now()
	_, err := c.Ensure(context.Background(), Source{Key: "deb", URL: srv.URL, Format: "qcow2"})
	<-stalled
	if !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("Ensure = %v, want transient", err)
	}
	if time.Since(start) > 30*time.Second {
		t.Errorf("the stalled download was not ended by its own deadline")
	}
	if vols := f.Volumes(pool); len(vols) != 0 {
		t.Errorf("volumes left: %v", vols)
	}
}
