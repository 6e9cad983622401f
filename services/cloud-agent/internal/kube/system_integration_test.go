//go:build integration

package kube

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// startService builds and runs one proxyfleet service against conn; it is
// stopped with SIGTERM when the test ends. It returns a function that reads
// the service's log.
func startService(t *testing.T, conn *bus.Conn, dir, svc string, args ...string) func() string {
	t.Helper()
	bin := filepath.Join(dir, "bin", svc)
	if b, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", bin, "proxyfleet/services/"+svc+"/cmd/"+svc).CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", svc, err, b)
	}
	logPath := filepath.Join(dir, svc+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	common := []string{"--nats-url", conn.ClientURL(), "--data-dir", filepath.Join(dir, svc), "--log-level", "debug"}
	cmd := exec.Command(bin, append(common, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		testwait.Stop(cmd, syscall.SIGTERM, 15*time.Second)
	})
	return func() string { b, _ := os.ReadFile(logPath); return string(b) }
}

// untilServed calls fn, one request of the planner's API, again while no
// planner answers yet, and fails the test on any other error.
func untilServed(t *testing.T, what string, fn func(context.Context) error) {
	t.Helper()
	var err error
	for range 100 { // the planner may still be starting
		if err = fn(context.Background()); !errors.Is(err, api.ErrNoReply) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

type proxyView struct {
	Pool    string `json:"pool"`
	State   string `json:"state"`
	Address string `json:"address"`
}

func poolViews(t *testing.T, conn *bus.Conn, pool string) []proxyView {
	ctx := context.Background()
	kv, err := conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []proxyView
	for k := range keys.Keys() {
		if e, err := kv.Get(ctx, k); err == nil {
			var v proxyView
			if json.Unmarshal(e.Value(), &v) == nil && v.Pool == pool {
				out = append(out, v)
			}
		}
	}
	return out
}

// agentKubeconfig writes a kubeconfig that reaches the test API server as
// the agent's service account (by impersonation).
func agentKubeconfig(t *testing.T, dir string) string {
	t.Helper()
	cfg := adminConfig(t)
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: %q, certificate-authority-data: %s}
users:
- name: agent
  user:
    token: %q
    as: %q
    as-groups: [system:serviceaccounts, system:serviceaccounts:proxyfleet, system:authenticated]
contexts:
- name: test
  context: {cluster: test, user: agent}
current-context: test
`, cfg.Host, base64.StdEncoding.EncodeToString(cfg.CAData), cfg.BearerToken, agentSubject)
	path := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestSystemPoolOnKubernetes: a pool of 2 on a kubernetes entry, through
// planner, health and the cloud-agent binary against the real API server,
// reaches running with Pod IPs (the test plays the kubelet); deleting the
// pool removes every Pod and Secret; no service logs the proxy password.
func TestSystemPoolOnKubernetes(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("system")
	dir := t.TempDir()
	conn := bustest.Start(t)
	cfgPath := filepath.Join(dir, "cloud-agent.yaml")
	cfg := fmt.Sprintf("entries:\n  - name: k8s\n    type: kubernetes\n    targets: [%s]\n    kubernetes: {kubeconfig: %s}\n", ns, agentKubeconfig(t, dir))
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	// Health binds its echo endpoint where the kernel puts it.
	echo := "127.0.0.1:0"
	var err error
	agentLog := startService(t, conn, dir, "cloud-agent", "--config", cfgPath)
	plannerLog := startService(t, conn, dir, "planner", "--reconcile-interval", "200ms")
	// Pod IPs here answer no probes: keep health from declaring them
	// unhealthy (and the planner from replacing them) during the test.
	healthLog := startService(t, conn, dir, "health", "--echo-addr", echo, "--probe-interval", "1h", "--unhealthy-after", "1000", "--check-interval", "1s")

	const password = "pw-kube-system-canary"
	planner := api.NewClient(conn.NC, api.WithTimeout(5*time.Second))
	untilServed(t, "pool.apply kpool", func(ctx context.Context) error {
		_, err := planner.PoolApply(ctx, events.PoolSpec{Name: "kpool", Provider: "k8s", Size: 2, Auth: &events.ProxyAuth{Username: "crawler", Password: password}})
		return err
	})
	ctx := context.Background()
	ips := map[string]string{}
	err = poll(120*time.Second, func() error {
		// Play the kubelet: every new Pod runs and gets an IP.
		pods, err := e.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if p.Status.PodIP == "" {
				ip := fmt.Sprintf("10.244.9.%d", len(ips)+1)
				ips[p.Name] = ip
				e.setStatus(ns, p.Name, corev1.PodRunning, ip)
			}
		}
		views := poolViews(t, conn, "kpool")
		if len(views) != 2 {
			return fmt.Errorf("%d proxies in view", len(views))
		}
		for _, v := range views {
			if v.State != "running" || !strings.HasPrefix(v.Address, "10.244.9.") || !strings.HasSuffix(v.Address, ":3128") {
				return fmt.Errorf("proxy %+v not running yet", v)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("pool never ran: %v\n--- cloud-agent:\n%s\n--- planner:\n%s", err, tailOf(agentLog()), tailOf(plannerLog()))
	}

	untilServed(t, "pool.delete kpool", func(ctx context.Context) error {
		_, err := planner.PoolDelete(ctx, "kpool")
		return err
	})
	err = poll(120*time.Second, func() error {
		pods, err := e.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		secrets, err := e.admin.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelProxy})
		if err != nil {
			return err
		}
		if n := len(pods.Items) + len(secrets.Items) + len(poolViews(t, conn, "kpool")); n != 0 {
			return fmt.Errorf("%d pods, %d secrets left", len(pods.Items), len(secrets.Items))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("pool deletion: %v\n--- cloud-agent:\n%s", err, tailOf(agentLog()))
	}
	for name, log := range map[string]func() string{"cloud-agent": agentLog, "planner": plannerLog, "health": healthLog} {
		if strings.Contains(log(), password) {
			t.Errorf("%s logs the proxy password", name)
		}
	}
}

func tailOf(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}
