//go:build integration && kubenode

package kube

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// The node tier: `make test-kube-node` runs this file inside
// scripts/kube-node-tier.sh, which starts a containerd of its own in the
// network namespace PFKUBE_NETNS (joined to the host by a veth pair,
// PFKUBE_HOST_IP on the host side, PFKUBE_NODE_IP on the namespace side,
// the Pods' bridge network routed to it) with the locally built Squid image
// PFKUBE_SQUID_IMAGE imported. The test adds a kube-scheduler and a
// kubelet to the control plane of the other tests.

// nodeName is the node the kubelet registers.
const nodeName = "pfkube-node"

type nodeTier struct {
	netns, hostIP, nodeIP, podCIDR, cri, cgroupRoot, squidImage string
	kubelet, scheduler                                          string
}

func nodeTierEnv(t *testing.T) nodeTier {
	t.Helper()
	n := nodeTier{netns: os.Getenv("PFKUBE_NETNS"), hostIP: os.Getenv("PFKUBE_HOST_IP"), nodeIP: os.Getenv("PFKUBE_NODE_IP"),
		podCIDR: os.Getenv("PFKUBE_POD_CIDR"), cri: os.Getenv("PFKUBE_CRI"), cgroupRoot: os.Getenv("PFKUBE_CGROUP_ROOT"),
		squidImage: os.Getenv("PFKUBE_SQUID_IMAGE")}
	testgate.Need(t, n.netns != "" && n.cri != "" && n.squidImage != "",
		"no node tier around the test (PFKUBE_* unset); run `make test-kube-node`")
	bins := filepath.Join(cacheDir(), "kube-"+KubeVersion)
	n.kubelet = envOr("KUBELET", filepath.Join(bins, "kubelet"))
	n.scheduler = envOr("KUBE_SCHEDULER", filepath.Join(bins, "kube-scheduler"))
	testgate.NeedFile(t, n.kubelet, "kubelet "+KubeVersion+"; `make kube-bins` builds it")
	testgate.NeedFile(t, n.scheduler, "kube-scheduler "+KubeVersion+"; `make kube-bins` builds it")
	return n
}

// forward accepts on ln and copies each connection to and from target:
// the kubelet, in its own network namespace, reaches the kube-apiserver
// (which listens on loopback) through it.
func forward(t *testing.T, ln net.Listener, target string) {
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer u.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(u, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, u); done <- struct{}{} }()
				<-done
			}()
		}
	}()
}

// kubeconfig writes a kubeconfig with the admin token for server; the
// serving certificate names localhost.
func kubeconfig(t *testing.T, path, server string, cfg *rest.Config) string {
	t.Helper()
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: %q, certificate-authority-data: %s, tls-server-name: localhost}
users:
- name: admin
  user: {token: %q}
contexts:
- name: test
  context: {cluster: test, user: admin}
current-context: test
`, server, base64.StdEncoding.EncodeToString(cfg.CAData), cfg.BearerToken)
	must(t, os.WriteFile(path, []byte(kc), 0o600))
	return path
}

// startProc runs a control-plane process until the test ends.
func startProc(t *testing.T, dir, name string, argv ...string) func() string {
	t.Helper()
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.Create(logPath)
	must(t, err)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	must(t, cmd.Start())
	t.Cleanup(func() {
		testwait.Stop(cmd, syscall.SIGTERM, 20*time.Second)
	})
	return func() string { b, _ := os.ReadFile(logPath); return tailOf(string(b)) }
}

// kubeletConfig is the node's KubeletConfiguration: cgroupfs under its own
// cgroup root, no server (probes need none), no image garbage collection
// or eviction on a busy test disk, and no swap or cgroup v1 refusal.
func kubeletConfig(n nodeTier) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
enableServer: false
healthzPort: 0
readOnlyPort: 0
cgroupDriver: cgroupfs
cgroupRoot: %s
cgroupsPerQOS: true
failSwapOn: false
failCgroupV1: false
oomScoreAdj: 0
containerRuntimeEndpoint: %s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "0%%", imagefs.available: "0%%", nodefs.inodesFree: "0%%", imagefs.inodesFree: "0%%"}
nodeStatusUpdateFrequency: 2s
syncFrequency: 10s
fileCheckFrequency: 5s
registerNode: true
`, n.cgroupRoot, n.cri)
}

// startNode starts kube-scheduler and a kubelet, waits for the node to be
// Ready and removes its not-ready taint: no kube-controller-manager runs,
// and its node lifecycle controller is what removes that taint in a real
// cluster.
func startNode(t *testing.T, e *kubeEnv, n nodeTier, dir string) {
	t.Helper()
	cfg := adminConfig(t)
	apiAddr := strings.TrimPrefix(cfg.Host, "https://")
	ln, err := net.Listen("tcp", net.JoinHostPort(n.hostIP, "0"))
	must(t, err)
	forward(t, ln, apiAddr)
	schedLog := startProc(t, dir, "kube-scheduler", n.scheduler,
		"--kubeconfig="+kubeconfig(t, filepath.Join(dir, "scheduler.kubeconfig"), cfg.Host, cfg),
		"--leader-elect=false", "--secure-port=0", "--v=1")
	kcfg := filepath.Join(dir, "kubelet.yaml")
	must(t, os.WriteFile(kcfg, []byte(kubeletConfig(n)), 0o600))
	kubeletLog := startProc(t, dir, "kubelet", "nsenter", "--net="+n.netns, n.kubelet,
		"--config="+kcfg, "--kubeconfig="+kubeconfig(t, filepath.Join(dir, "kubelet.kubeconfig"), "https://"+ln.Addr().String(), cfg),
		// The kubelet makes its root a shared mount: keep it in the tier's
		// directory, which the tier script unmounts and removes.
		"--root-dir="+filepath.Join(os.Getenv("PFKUBE_DIR"), "kubelet"), "--hostname-override="+nodeName, "--node-ip="+n.nodeIP, "--v=1")
	start := time.Now()
	err = poll(180*time.Second, func() error {
		node, err := e.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status != corev1.ConditionTrue {
				return fmt.Errorf("node not ready: %s", c.Message)
			}
		}
		var kept []corev1.Taint
		for _, tn := range node.Spec.Taints {
			if tn.Key != "node.kubernetes.io/not-ready" {
				kept = append(kept, tn)
			}
		}
		if len(kept) != len(node.Spec.Taints) {
			node.Spec.Taints = kept
			if _, err := e.admin.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
				return err
			}
			return fmt.Errorf("taint removed, checking")
		}
		if len(kept) != 0 {
			return fmt.Errorf("node taints %v", kept)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("node never became ready: %v\n--- kubelet:\n%s\n--- kube-scheduler:\n%s\n--- containerd:\n%s",
			err, kubeletLog(), schedLog(), containerdLog())
	}
	t.Logf("node %s ready %.1fs after the kubelet started", nodeName, time.Since(start).Seconds())
}

func containerdLog() string {
	b, _ := os.ReadFile(os.Getenv("PFKUBE_CONTAINERD_LOG"))
	return tailOf(string(b))
}

// echoServer answers {"ip": caller} on the host side of the veth pair: the
// egress echo endpoint the probes fetch through each Pod's Squid.
func echoServer(t *testing.T, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	must(t, err)
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, _, _ := net.SplitHostPort(r.RemoteAddr)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"ip": h})
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// TestNodePoolOnRealKubelet: a pool on a kubernetes entry, through planner,
// health and the cloud-agent binary, runs its Pods on a real kubelet with
// containerd, runc and the bridge CNI, from the Squid image built from
// Debian packages; health probes each proxy ready through its Squid with
// basic auth; the pool is scaled 2 → 3 → 1 and deleted, leaving no Pod,
// Secret or ConfigMap.
func TestNodePoolOnRealKubelet(t *testing.T) {
	n := nodeTierEnv(t)
	e := newKubeEnv(t)
	dir := t.TempDir()
	startNode(t, e, n, dir)
	ns := e.namespace("node")
	podNet := netip.MustParsePrefix(n.podCIDR)

	echo := echoServer(t, n.hostIP)
	_, echoPort, _ := net.SplitHostPort(echo)
	conn := bustest.Start(t)
	cfgPath := filepath.Join(dir, "cloud-agent.yaml")
	cfg := fmt.Sprintf("entries:\n  - name: k8s\n    type: kubernetes\n    targets: [%s]\n    kubernetes: {kubeconfig: %s, image: %q}\n",
		ns, agentKubeconfig(t, dir), n.squidImage)
	must(t, os.WriteFile(cfgPath, []byte(cfg), 0o600))
	agentLog := startService(t, conn, dir, "cloud-agent", "--config", cfgPath)
	plannerLog := startService(t, conn, dir, "planner", "--reconcile-interval", "200ms")
	healthLog := startService(t, conn, dir, "health", "--echo-addr", "", "--echo-url", "http://"+echo+"/",
		"--probe-interval", "1s", "--check-interval", "1s")
	logs := func() string {
		return fmt.Sprintf("\n--- cloud-agent:\n%s\n--- planner:\n%s\n--- health:\n%s", tailOf(agentLog()), tailOf(plannerLog()), tailOf(healthLog()))
	}

	const user, password = "crawler", "pw-kube-node-canary"
	port, perr := strconv.Atoi(echoPort)
	if perr != nil {
		t.Fatalf("echo port %q: %v", echoPort, perr)
	}
	planner := api.NewClient(conn.NC, api.WithTimeout(5*time.Second))
	apply := func(size int) {
		untilServed(t, "pool.apply npool", func(ctx context.Context) error {
			_, err := planner.PoolApply(ctx, events.PoolSpec{Name: "npool", Provider: "k8s", Size: size,
				Auth:   &events.ProxyAuth{Username: user, Password: password},
				Egress: &events.Egress{AllowCIDRs: []string{n.hostIP + "/32"}, AllowPorts: []int{port}}})
			return err
		})
	}
	ctx := context.Background()
	// settle waits until the pool has size proxies, all ready at Pod
	// addresses, and exactly size Pods (none left terminating).
	settle := func(size int) []proxyView {
		start := time.Now()
		var views []proxyView
		err := poll(240*time.Second, func() error {
			views = poolViews(t, conn, "npool")
			if len(views) != size {
				return fmt.Errorf("%d proxies in view, want %d", len(views), size)
			}
			for _, v := range views {
				ap, err := netip.ParseAddrPort(v.Address)
				if v.State != "ready" || err != nil || !podNet.Contains(ap.Addr()) {
					return fmt.Errorf("proxy %+v not ready at a Pod address", v)
				}
			}
			pods, err := e.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			if len(pods.Items) != size {
				return fmt.Errorf("%d pods, want %d", len(pods.Items), size)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("pool of %d: %v%s", size, err, logs())
		}
		t.Logf("pool of %d ready in %.1fs", size, time.Since(start).Seconds())
		return views
	}

	apply(2)
	views := settle(2)
	for _, v := range views {
		checkSquidAuth(t, v.Address, echo, user, password)
	}
	apply(3)
	settle(3)
	apply(1)
	settle(1)

	start := time.Now()
	untilServed(t, "pool.delete npool", func(ctx context.Context) error {
		_, err := planner.PoolDelete(ctx, "npool")
		return err
	})
	err := poll(180*time.Second, func() error {
		pods, err := e.admin.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		secrets, err := e.admin.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		cms, err := e.admin.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(pods.Items)+len(secrets.Items)+len(cms.Items)+len(poolViews(t, conn, "npool")) != 0 {
			return fmt.Errorf("%d pods, %d secrets, %d configmaps left", len(pods.Items), len(secrets.Items), len(cms.Items))
		}
		return nil
	})
	if err != nil {
		t.Fatalf("pool deletion: %v%s", err, logs())
	}
	t.Logf("pool deleted, nothing left, in %.1fs", time.Since(start).Seconds())
	for name, log := range map[string]func() string{"cloud-agent": agentLog, "planner": plannerLog, "health": healthLog} {
		if strings.Contains(log(), password) {
			t.Errorf("%s logs the proxy password", name)
		}
	}
}

// checkSquidAuth fetches the echo endpoint through the Squid at proxy:
// 407 without credentials, 200 with them, and the echo sees the Pod's
// address.
func checkSquidAuth(t *testing.T, proxy, echo, user, password string) {
	t.Helper()
	get := func(u *url.URL) (int, string) {
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(u)}}
		resp, err := c.Get("http://" + echo + "/")
		if err != nil {
			t.Fatalf("through %s: %v", proxy, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(&url.URL{Scheme: "http", Host: proxy}); code != http.StatusProxyAuthRequired {
		t.Fatalf("through %s without credentials: %d; want 407", proxy, code)
	}
	code, body := get(&url.URL{Scheme: "http", Host: proxy, User: url.UserPassword(user, password)})
	host, _, _ := net.SplitHostPort(proxy)
	if code != http.StatusOK || !strings.Contains(body, `"`+host+`"`) {
		t.Fatalf("through %s with credentials: %d %q; want 200 from the Pod's address", proxy, code, body)
	}
}
