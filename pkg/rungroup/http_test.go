package rungroup_test

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"proxyfleet/pkg/rungroup"
)

func TestHTTPMember(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	inFlight := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			close(inFlight)
			time.Sleep(50 * time.Millisecond)
		}
		_, _ = w.Write([]byte("ok"))
	}), ReadHeaderTimeout: time.Second}
	var g rungroup.Group
	g.Add(rungroup.HTTP("echo", srv, ln, 5*time.Second))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()

	url := "http://" + ln.Addr().String()
	resp, err := http.Get(url + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	// A request in flight when the stop comes is answered.
	slow := make(chan error, 1)
	go func() {
		resp, err := http.Get(url + "/slow")
		if err == nil {
			err = resp.Body.Close()
		}
		slow <- err
	}()
	<-inFlight
	cancel()
	if err := <-slow; err != nil {
		t.Errorf("request in flight at the stop: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if _, err := http.Get(url + "/"); err == nil {
		t.Error("still serving after the stop")
	}
	http.DefaultClient.CloseIdleConnections()
}
