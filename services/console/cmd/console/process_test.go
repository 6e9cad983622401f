package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// TestConsoleProcessShowsTheViews runs the console binary against an
// embedded NATS server: a pool and a proxy written to the views appear
// on its pages, a pool removed from the view leaves them, and SIGTERM
// stops it cleanly with a live stream open.
func TestConsoleProcessShowsTheViews(t *testing.T) {
	ctx := testwait.Context(t, 120*time.Second)
	conn := bustest.Start(t)
	bin := filepath.Join(t.TempDir(), "console")
	if out, err := exec.CommandContext(ctx, "go", "build", "-tags", "grpcnotrace", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	var out testwait.Buffer
	cmd := exec.Command(bin, "--nats-url", conn.ClientURL(), "--data-dir", t.TempDir(), "--listen", "127.0.0.1:0", "--history-every", "1s")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("console output:\n%s", out.String())
		}
	})
	addrRE := regexp.MustCompile(`"msg":"console serving".*"listen":"([^"]+)"`)
	var base string
	testwait.Until(t, 30*time.Second, "the console serves", func() bool {
		if m := addrRE.FindStringSubmatch(out.String()); m != nil {
			base = "http://" + m[1]
			return true
		}
		return false
	})

	put := func(bucket, key string, v any) {
		t.Helper()
		kv, err := conn.JS.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(v)
		if _, err := kv.Put(ctx, key, b); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UTC()
	put(bus.BucketPools, "demo", map[string]any{"name": "demo", "provider": "local", "size": 1, "revision": 1,
		"spec": events.PoolSpec{Name: "demo", Provider: "local", Size: 1}, "createdAt": now})
	put(bus.BucketProxies, "demo-aaaa", events.ProxyView{ID: "demo-aaaa", Pool: "demo", State: events.ProxyReady, Entry: "local", Target: "t1", CreatedAt: now})

	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	testwait.Until(t, 20*time.Second, "the pool on the fleet page", func() bool {
		_, body := get("/")
		return strings.Contains(body, `<tr id="pool-demo" data-desired="1" data-ready="1" data-live="1">`)
	})
	if code, body := get("/pools/demo"); code != http.StatusOK || !strings.Contains(body, `<tr id="proxy-demo-aaaa" data-state="ready">`) {
		t.Fatalf("GET /pools/demo: %d\n%s", code, body)
	}

	// A live stream stays open while the console stops.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, _ := http.NewRequestWithContext(sctx, http.MethodGet, base+"/live/", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()

	kv, err := conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "demo-aaaa"); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the proxy leaves the fleet page", func() bool {
		_, body := get("/")
		return strings.Contains(body, `data-desired="1" data-ready="0" data-live="0"`)
	})

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err
		if err != nil {
			t.Fatalf("the console exited with %v after SIGTERM", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the console did not stop within 20s of SIGTERM with a live stream open")
	}
}
