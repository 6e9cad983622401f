package kube

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/services/cloud-agent/internal/config"
)

func TestStateMapping(t *testing.T) {
	d := New(nil, Options{Entry: "k8s", Namespace: "ns1"})
	now := metav1.Now()
	pod := func(phase corev1.PodPhase, ip string, deleting bool) *corev1.Pod {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "px-a", Namespace: "ns1"},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "squid", Ports: []corev1.ContainerPort{{Name: "proxy", ContainerPort: 8080}}}}},
			Status:     corev1.PodStatus{Phase: phase, PodIP: ip},
		}
		if deleting {
			p.DeletionTimestamp = &now
		}
		return p
	}
	cases := []struct {
		name string
		pod  *corev1.Pod
		want agent.State
		addr string
	}{
		{"pending", pod(corev1.PodPending, "", false), agent.StateProvisioning, ""},
		{"no phase yet", pod("", "", false), agent.StateProvisioning, ""},
		{"running without ip", pod(corev1.PodRunning, "", false), agent.StateProvisioning, ""},
		{"running", pod(corev1.PodRunning, "10.1.2.3", false), agent.StateRunning, "10.1.2.3:8080"},
		{"running ipv6", pod(corev1.PodRunning, "fd00::5", false), agent.StateRunning, "[fd00::5]:8080"},
		{"succeeded", pod(corev1.PodSucceeded, "10.1.2.3", false), agent.StateTerminated, ""},
		{"failed", pod(corev1.PodFailed, "", false), agent.StateTerminated, ""},
		{"unknown", pod(corev1.PodUnknown, "", false), agent.StateTerminated, ""},
		{"terminating", pod(corev1.PodRunning, "10.1.2.3", true), agent.StateTerminated, ""},
	}
	for _, c := range cases {
		got := d.toInstance(c.pod)
		if got.State != c.want || got.Address != c.addr || got.ProviderID != "ns1/px-a" {
			t.Errorf("%s: %+v, want state %s address %q provider ns1/px-a", c.name, got, c.want, c.addr)
		}
	}
}

func TestClassify(t *testing.T) {
	gr := schema.GroupResource{Resource: "pods"}
	cases := []struct {
		name string
		err  error
		want error
	}{
		{"not found", apierrors.NewNotFound(gr, "px-a"), agent.ErrNotFound},
		{"quota", apierrors.NewForbidden(gr, "px-a", errors.New("exceeded quota: pods, requested: pods=1, used: pods=10, limited: pods=10")), agent.ErrQuotaExceeded},
		{"forbidden", apierrors.NewForbidden(gr, "px-a", errors.New("User cannot create resource")), agent.ErrPermanent},
		{"invalid", apierrors.NewInvalid(schema.GroupKind{Kind: "Pod"}, "px-a", nil), agent.ErrPermanent},
		{"bad request", apierrors.NewBadRequest("bad"), agent.ErrPermanent},
		{"too many requests", apierrors.NewTooManyRequests("slow down", 1), agent.ErrTransient},
		{"server timeout", apierrors.NewServerTimeout(gr, "create", 1), agent.ErrTransient},
		{"internal", apierrors.NewInternalError(errors.New("etcd")), agent.ErrTransient},
		{"unavailable", apierrors.NewServiceUnavailable("down"), agent.ErrTransient},
		{"conflict", apierrors.NewConflict(gr, "px-a", errors.New("uid precondition")), agent.ErrTransient},
		{"deadline", context.DeadlineExceeded, agent.ErrTransient},
		{"network", errors.New("dial tcp 10.0.0.1:6443: connect: connection refused"), agent.ErrTransient},
	}
	for _, c := range cases {
		if got := classify(c.err); !errors.Is(got, c.want) {
			t.Errorf("%s: classify = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestPodSpec(t *testing.T) {
	d := New(nil, Options{Entry: "k8s", Namespace: "ns1", Config: config.Kubernetes{
		Image: "ubuntu/squid:6.6-24.04_edge", Images: map[string]string{"squid6": "ubuntu/squid:6.10"},
		Profiles: map[string]config.Resources{"small": {CPU: "100m", Memory: "64Mi", MemoryLimit: "128Mi"}, "bad": {CPU: "lots"}},
	}})
	s := agent.Spec{ProxyID: "pool-a-x", Pool: "pool-a", Entry: "k8s", Name: events.InstanceName("pool-a-x"), Port: 8080, Image: "squid6", Profile: "small",
		Auth: &events.ProxyAuth{Username: "u", Password: "pw-canary"}, UserData: []byte("#cloud-config")}
	pod, err := d.podFor(s)
	if err != nil {
		t.Fatal(err)
	}
	c := pod.Spec.Containers[0]
	if c.Image != "ubuntu/squid:6.10" || c.Ports[0].ContainerPort != 8080 || c.Resources.Limits.Memory().String() != "128Mi" {
		t.Fatalf("container = %+v", c)
	}
	if pod.Labels[LabelProxy] != "pool-a-x" || pod.Labels[LabelEntry] != "k8s" || pod.Labels[LabelPool] != "pool-a" {
		t.Fatalf("labels = %v", pod.Labels)
	}
	if got := fmt.Sprintf("%+v", pod); strings.Contains(got, "pw-canary") || len(pod.Annotations) != 0 {
		t.Fatal("the pod spec carries the password or annotations")
	}
	for _, bad := range []agent.Spec{{Image: "nope"}, {Profile: "nope"}, {Profile: "bad"}} {
		if _, err := d.podFor(bad); !errors.Is(err, agent.ErrPermanent) {
			t.Errorf("podFor(%+v) = %v, want ErrPermanent", bad, err)
		}
	}
}

func TestProviderID(t *testing.T) {
	d := New(nil, Options{Entry: "k8s", Namespace: "ns1"})
	cases := []struct {
		ref      agent.Ref
		ns, name string
		err      error
	}{
		{agent.Ref{ProviderID: "ns2/px-a"}, "ns2", "px-a", nil},
		{agent.Ref{Name: "px-b"}, "ns1", "px-b", nil},
		{agent.Ref{ProviderID: "px-a"}, "", "", agent.ErrPermanent},
		{agent.Ref{ProviderID: "a/b/c"}, "", "", agent.ErrPermanent},
		{agent.Ref{}, "", "", agent.ErrPermanent},
	}
	for _, c := range cases {
		ns, name, err := d.locate(c.ref)
		if ns != c.ns || name != c.name || !errors.Is(err, c.err) && (err != nil || c.err != nil) {
			t.Errorf("locate(%+v) = %q %q %v, want %q %q %v", c.ref, ns, name, err, c.ns, c.name, c.err)
		}
	}
}

func TestRESTConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	kc := `apiVersion: v1
kind: Config
clusters:
- name: a
  cluster: {server: "https://10.0.0.1:6443"}
- name: b
  cluster: {server: "https://10.0.0.2:6443"}
users:
- name: u
  user: {token: tok}
contexts:
- name: ctx-a
  context: {cluster: a, user: u}
- name: ctx-b
  context: {cluster: b, user: u}
current-context: ctx-a
`
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	for ctxName, want := range map[string]string{"": "https://10.0.0.1:6443", "ctx-b": "https://10.0.0.2:6443"} {
		c, err := RESTConfig(path, ctxName)
		if err != nil || c.Host != want {
			t.Errorf("RESTConfig(%q) = %v, %v; want host %s", ctxName, c, err, want)
		}
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := RESTConfig("", ""); err == nil || !strings.Contains(err.Error(), "kubeconfig") {
		t.Errorf("in-cluster config outside a cluster: %v, want an error naming kubernetes.kubeconfig", err)
	}
}

// TestPodIsHardened checks what Pod Security "restricted" does not: a
// read-only root filesystem with writable emptyDirs where Squid writes,
// both probes on the proxy port, the configured numeric user; and what it
// does, so a unit run catches a regression before the apiserver tier.
func TestPodIsHardened(t *testing.T) {
	d := New(nil, Options{Entry: "k8s", Namespace: "ns1", Config: config.Kubernetes{Image: "squid:6.6", RunAsUser: 4242}})
	pod, err := d.podFor(agent.Spec{ProxyID: "pool-a-1", Pool: "pool-a", Entry: "k8s", Name: "px-1", Port: 8080})
	if err != nil {
		t.Fatal(err)
	}
	ps, c := pod.Spec.SecurityContext, pod.Spec.Containers[0]
	sc := c.SecurityContext
	if ps == nil || sc == nil {
		t.Fatalf("no security context: pod %+v container %+v", ps, sc)
	}
	if !*ps.RunAsNonRoot || *ps.RunAsUser != 4242 || *ps.RunAsGroup != 4242 || ps.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context = %+v", ps)
	}
	if !*sc.ReadOnlyRootFilesystem || *sc.AllowPrivilegeEscalation || !*sc.RunAsNonRoot ||
		len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
		t.Errorf("container security context = %+v", sc)
	}
	for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe} {
		if p == nil || p.TCPSocket == nil || p.TCPSocket.Port.IntValue() != 8080 {
			t.Errorf("probe %+v, want tcpSocket on 8080", p)
		}
	}
	emptyDirs := map[string]bool{}
	for _, v := range pod.Spec.Volumes {
		if v.EmptyDir != nil {
			emptyDirs[v.Name] = true
		}
	}
	writable := map[string]bool{}
	for _, m := range c.VolumeMounts {
		if emptyDirs[m.Name] && !m.ReadOnly {
			writable[m.MountPath] = true
		}
	}
	for _, dir := range []string{"/tmp", "/var/spool/squid", "/var/log/squid", "/run/squid"} {
		if !writable[dir] {
			t.Errorf("%s is not a writable emptyDir: mounts %+v", dir, c.VolumeMounts)
		}
	}
	if *pod.Spec.AutomountServiceAccountToken {
		t.Error("the Squid Pod mounts a service account token")
	}
}
