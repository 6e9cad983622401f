package service_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/service"
)

// relay forwards every connection accepted on a kernel-chosen loopback
// port to target, and can cut them all, so that a client reconnects to the
// same address while the server keeps running.
type relay struct {
	ln     net.Listener
	mu     sync.Mutex
	conns  []net.Conn
	target string
}

func startRelay(t *testing.T, target string) *relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{ln: ln, target: target}
	t.Cleanup(func() { _ = ln.Close(); r.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			r.mu.Lock()
			r.conns = append(r.conns, c, s)
			r.mu.Unlock()
			go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
			go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
		}
	}()
	return r
}

func (r *relay) cut() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		_ = c.Close()
	}
	r.conns = nil
}

// captureStderr sends what is written to os.Stderr to the returned buffer
// until restore is called.
func captureStderr(t *testing.T) (out *bytes.Buffer, restore func()) {
	t.Helper()
	rd, wr, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	saved := os.Stderr
	os.Stderr = wr
	out = &bytes.Buffer{}
	done := make(chan struct{})
	go func() { _, _ = io.Copy(out, rd); close(done) }()
	var once sync.Once
	restore = func() {
		once.Do(func() {
			os.Stderr = saved
			_ = wr.Close()
			<-done
			_ = rd.Close()
		})
	}
	t.Cleanup(restore)
	return out, restore
}

// TestStartNeverLogsTheURLPassword runs a service's start-up with a URL
// holding a password, at debug level, through a connection failure with a
// wrong password, a reconnect, and a caller that logs the URL as it is:
// the password appears nowhere in the output.
func TestStartNeverLogsTheURLPassword(t *testing.T) {
	const password, wrong = "s3cret-pw-7d1f", "wr0ng-pw-91ac"
	srv := bustest.Server(t, &server.Options{
		Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(),
		Users: []*server.User{{Username: "planner", Password: password}},
	})
	rl := startRelay(t, srv.Addr().String())
	addr := rl.ln.Addr().String()

	out, restore := captureStderr(t)
	ctx := context.Background()
	flags := func(pw string) service.Flags {
		return service.Flags{NATSURL: "nats://planner:" + pw + "@" + addr, DataDir: t.TempDir(), LogLevel: "debug", EnsureTopology: true}
	}
	if _, err := service.Start(ctx, "planner", flags(wrong)); err == nil {
		t.Fatal("Start with a wrong password succeeded")
	} else if strings.Contains(err.Error(), wrong) || !strings.Contains(err.Error(), "planner:xxxxx@") {
		t.Errorf("Start error %q shows the password, or not the redacted URL", err)
	}
	base, err := service.Start(ctx, "planner", flags(password))
	if err != nil {
		restore()
		t.Fatalf("Start: %v\n%s", err, out)
	}
	base.Log.Info("planner starting", "nats", base.Conn.ClientURL())
	rl.cut()
	deadline := time.Now().Add(10 * time.Second)
	for base.Conn.NC.Stats().Reconnects == 0 || !base.Conn.NC.IsConnected() {
		if time.Now().After(deadline) {
			base.Close()
			restore()
			t.Fatalf("no reconnect after the relay cut the connection:\n%s", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	base.Close()
	restore()

	logged := out.String()
	if strings.Contains(logged, password) || strings.Contains(logged, wrong) {
		t.Fatalf("a password reached the log:\n%s", logged)
	}
	for _, want := range []string{`"msg":"nats reconnected"`, `"nats":"nats://planner:xxxxx@` + addr} {
		if !strings.Contains(logged, want) {
			t.Errorf("log lacks %s:\n%s", want, logged)
		}
	}
}
