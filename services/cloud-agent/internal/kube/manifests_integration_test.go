//go:build integration

package kube

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/cloud-agent/internal/config"
)

const (
	manifestDir     = "../../../../deploy/kubernetes"
	overlayManifest = manifestDir + "/cluster-scope/rbac.yaml"
	agentNamespace  = "proxyfleet"
)

// shippedKinds maps every kind the shipped manifests use to its resource.
var shippedKinds = map[string]struct {
	gvr        schema.GroupVersionResource
	namespaced bool
}{
	"Namespace":          {schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}, false},
	"ServiceAccount":     {schema.GroupVersionResource{Version: "v1", Resource: "serviceaccounts"}, true},
	"ConfigMap":          {schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}, true},
	"Secret":             {schema.GroupVersionResource{Version: "v1", Resource: "secrets"}, true},
	"Service":            {schema.GroupVersionResource{Version: "v1", Resource: "services"}, true},
	"Deployment":         {schema.GroupVersionResource{Group: "apps", Version: "v1", Resource: "deployments"}, true},
	"Role":               {schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "roles"}, true},
	"RoleBinding":        {schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "rolebindings"}, true},
	"ClusterRole":        {schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterroles"}, false},
	"ClusterRoleBinding": {schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterrolebindings"}, false},
}

// warnings collects the API server's warning headers (PodSecurity answers
// a workload that would violate the namespace's level with one).
type warnings struct {
	mu   sync.Mutex
	list []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.list = append(w.list, text)
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.list
	w.list = nil
	return out
}

// TestManifestsDryRun applies every manifest of deploy/kubernetes and of
// the cluster-scope overlay with server-side dry-run: the API server
// validates each object, and PodSecurity checks the Deployment against
// the "restricted" level rbac.yaml puts on the proxyfleet namespace.
func TestManifestsDryRun(t *testing.T) {
	newKubeEnv(t) // creates rbac.yaml's namespaces for real, so namespaced objects can be dry-run in them
	cfg := adminConfig(t)
	warn := &warnings{}
	cfg.WarningHandler = warn
	dyn := dynamic.NewForConfigOrDie(cfg)

	files, err := filepath.Glob(manifestDir + "/*.yaml")
	must(t, err)
	files = append(files, overlayManifest)
	if len(files) < 3 {
		t.Fatalf("manifests found: %v", files)
	}
	seen := map[string]bool{}
	for _, file := range files {
		for _, raw := range manifestDocs(t, file) {
			var obj unstructured.Unstructured
			must(t, obj.UnmarshalJSON(raw))
			kind := obj.GetKind()
			k, ok := shippedKinds[kind]
			if !ok {
				t.Fatalf("%s: kind %s has no resource in this test; add it", file, kind)
			}
			if k.namespaced != (obj.GetNamespace() != "") {
				t.Fatalf("%s: %s %s: namespace %q for a namespaced=%v kind", file, kind, obj.GetName(), obj.GetNamespace(), k.namespaced)
			}
			var r dynamic.ResourceInterface = dyn.Resource(k.gvr)
			if k.namespaced {
				r = dyn.Resource(k.gvr).Namespace(obj.GetNamespace())
			}
			_, err := r.Apply(tctx(t), obj.GetName(), &obj, metav1.ApplyOptions{FieldManager: "proxyfleet-test", Force: true, DryRun: []string{metav1.DryRunAll}})
			if err != nil {
				t.Errorf("%s: dry-run apply of %s %s: %v", file, kind, obj.GetName(), err)
			}
			if w := warn.take(); len(w) > 0 {
				t.Errorf("%s: %s %s: API server warnings %q", file, kind, obj.GetName(), w)
			}
			seen[strings.TrimPrefix(file, manifestDir+"/")+":"+kind] = true
		}
	}
	for _, want := range []string{"rbac.yaml:Role", "rbac.yaml:RoleBinding", "cloud-agent.yaml:Deployment", "cluster-scope/rbac.yaml:ClusterRoleBinding"} {
		if !seen[want] {
			t.Errorf("no %s in the manifests", want)
		}
	}
	for _, cluster := range []string{"rbac.yaml:ClusterRole", "rbac.yaml:ClusterRoleBinding", "cloud-agent.yaml:ClusterRoleBinding"} {
		if seen[cluster] {
			t.Errorf("%s: the default grants cluster scope; it belongs in the cluster-scope overlay", cluster)
		}
	}
}

// shippedDeployment returns the Deployment of cloud-agent.yaml.
func shippedDeployment(t *testing.T) appsv1.Deployment {
	t.Helper()
	for _, raw := range manifestDocs(t, manifestDir+"/cloud-agent.yaml") {
		var d appsv1.Deployment
		must(t, json.Unmarshal(raw, &d))
		if d.Kind == "Deployment" {
			return d
		}
	}
	t.Fatal("cloud-agent.yaml has no Deployment")
	return appsv1.Deployment{}
}

// TestAgentPodIsRestricted creates (dry-run) the Pod the shipped
// Deployment would make in the shipped proxyfleet namespace, where
// PodSecurity enforces "restricted"; the same Pod without its seccomp
// profile is refused there, so the namespace does enforce.
func TestAgentPodIsRestricted(t *testing.T) {
	e := newKubeEnv(t)
	d := shippedDeployment(t)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cloud-agent-dry-run", Namespace: d.Namespace, Labels: d.Spec.Template.Labels},
		Spec: *d.Spec.Template.Spec.DeepCopy()}
	if d.Namespace != agentNamespace {
		t.Fatalf("the Deployment is in %q, want %q", d.Namespace, agentNamespace)
	}
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	if _, err := e.admin.CoreV1().Pods(d.Namespace).Create(tctx(t), pod, dry); err != nil {
		t.Fatalf("the agent's Pod in the restricted namespace: %v", err)
	}
	c := pod.Spec.Containers[0]
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || c.LivenessProbe == nil || c.ReadinessProbe == nil ||
		strings.HasSuffix(c.Image, ":latest") || !strings.Contains(c.Image, ":") {
		t.Errorf("agent container: read-only root, probes and a pinned image required: %+v", c)
	}
	args := strings.Join(c.Args, " ")
	for _, want := range []string{"--nats-nkey=/var/run/secrets/proxyfleet/nats.nk", "--nats-ca=/var/run/secrets/proxyfleet/ca.crt", "--ensure-topology=false"} {
		if !strings.Contains(args, want) {
			t.Errorf("agent args %q lack %s", args, want)
		}
	}

	bad := pod.DeepCopy()
	bad.Spec.SecurityContext.SeccompProfile = nil
	bad.Spec.Containers[0].SecurityContext.SeccompProfile = nil
	_, err := e.admin.CoreV1().Pods(d.Namespace).Create(tctx(t), bad, dry)
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "seccompProfile") {
		t.Fatalf("a Pod without a seccomp profile in %s: %v, want PodSecurity's refusal", d.Namespace, err)
	}
}

// TestSquidPodIsRestricted creates (dry-run) the Pod the driver builds in a
// namespace enforcing "restricted"; the same Pod without its security
// context is refused there.
func TestSquidPodIsRestricted(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("psa")
	d := e.driver("k8s", ns)
	pod, err := d.podFor(kspec("pool-k-psa", "k8s", ns, 1))
	must(t, err)
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	if _, err := e.admin.CoreV1().Pods(ns).Create(tctx(t), pod, dry); err != nil {
		t.Fatalf("the driver's Pod in a restricted namespace: %v", err)
	}
	bad := pod.DeepCopy()
	bad.Spec.SecurityContext = nil
	bad.Spec.Containers[0].SecurityContext = nil
	if _, err := e.admin.CoreV1().Pods(ns).Create(tctx(t), bad, dry); !apierrors.IsForbidden(err) {
		t.Fatalf("the driver's Pod without its security context: %v, want PodSecurity's refusal", err)
	}
}

// TestAgentRBACScope impersonates the agent's service account with the
// shipped rbac.yaml: refused Secrets and Pods outside its target
// namespaces (its own namespace and kube-system included) and any list
// across namespaces; allowed what the driver does in a target namespace.
func TestAgentRBACScope(t *testing.T) {
	e := newKubeEnv(t)
	ctx := tctx(t)
	// The NATS credentials the kubelet mounts for the agent: it must not
	// read them through the API.
	_, err := e.admin.CoreV1().Secrets(agentNamespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "cloud-agent-nats"},
		StringData: map[string]string{"nats.nk": "SU-not-a-seed"}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	agentCS := newClientset(t, agentConfig(t))
	refused := func(what string, err error) {
		t.Helper()
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s: %v, want Forbidden", what, err)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v, want allowed", what, err)
		}
	}
	_, err = agentCS.CoreV1().Secrets(agentNamespace).Get(ctx, "cloud-agent-nats", metav1.GetOptions{})
	refused("get secrets in proxyfleet", err)
	_, err = agentCS.CoreV1().Secrets("kube-system").Get(ctx, "anything", metav1.GetOptions{})
	refused("get secrets in kube-system", err)
	_, err = agentCS.CoreV1().Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	refused("list secrets cluster-wide", err)
	_, err = agentCS.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	refused("list pods cluster-wide", err)
	_, err = agentCS.CoreV1().Pods("kube-system").Create(ctx, restrictedPod("intruder", nil), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	refused("create pods in kube-system", err)

	// The shipped target namespace, bound by the shipped RoleBinding.
	_, err = e.admin.CoreV1().Secrets("proxies").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "scope-probe"}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	_, err = agentCS.CoreV1().Secrets("proxies").Get(ctx, "scope-probe", metav1.GetOptions{})
	allowed("get secrets in proxies", err)

	ns := e.namespace("scope")
	sec, err := agentCS.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}}, metav1.CreateOptions{})
	allowed("create secrets in a target", err)
	if err == nil {
		sec.StringData = map[string]string{"k": "v"}
		_, err = agentCS.CoreV1().Secrets(ns).Update(ctx, sec, metav1.UpdateOptions{})
		allowed("update secrets in a target", err)
		_, err = agentCS.CoreV1().Secrets(ns).Get(ctx, "s", metav1.GetOptions{})
		allowed("get secrets in a target", err)
		allowed("delete secrets in a target", agentCS.CoreV1().Secrets(ns).Delete(ctx, "s", metav1.DeleteOptions{}))
	}
	_, err = agentCS.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
	refused("list secrets in a target", err)
	_, err = agentCS.CoreV1().Pods(ns).Create(ctx, restrictedPod("p", nil), metav1.CreateOptions{})
	allowed("create pods in a target", err)
	_, err = agentCS.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	allowed("list pods in a target", err)
	allowed("delete pods in a target", agentCS.CoreV1().Pods(ns).Delete(ctx, "p", metav1.DeleteOptions{}))
	_, err = agentCS.CoreV1().Pods(ns).Create(ctx, restrictedPod("x", nil), metav1.CreateOptions{})
	_, err2 := agentCS.CoreV1().Pods(ns).Get(ctx, "x", metav1.GetOptions{})
	allowed("create and get pods in a target", errors.Join(err, err2))
	_, err = agentCS.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{})
	refused("list configmaps in a target", err)

	// The driver's own check agrees.
	if v := e.driver("k8s", ns).Check(ctx); len(v) != 2 || !v[0].OK || !v[1].OK || !strings.Contains(v[0].Detail, "in "+ns) {
		t.Errorf("check in a target: %+v", v)
	}
	bare := e.bareNamespace("scope-bare")
	if v := e.driver("k8s", bare).Check(ctx); v[0].OK || v[1].OK {
		t.Errorf("check in a namespace without the Role: %+v, want both failing", v)
	}
}

// overlayGroup carries the cluster-scope overlay in TestKubeClusterScopeOverlay
// only: the overlay's binding is applied to this group instead of the
// service account, so the other tests keep the namespaced default.
const overlayGroup = "proxyfleet-test:cluster-scope"

// applyOverlay creates the cluster-scope overlay as shipped, its binding's
// subjects replaced by overlayGroup.
func applyOverlay(t *testing.T, cs clientset) {
	t.Helper()
	ctx := tctx(t)
	var kinds []string
	for _, raw := range manifestDocs(t, overlayManifest) {
		var meta metav1.TypeMeta
		must(t, json.Unmarshal(raw, &meta))
		kinds = append(kinds, meta.Kind)
		if meta.Kind != "ClusterRole" && meta.Kind != "ClusterRoleBinding" {
			t.Fatalf("overlay: unexpected kind %s", meta.Kind)
		}
		err := createObject(ctx, t, cs, overlayManifest, meta.Kind, raw, func(obj any) {
			o, ok := obj.(*rbacv1.ClusterRoleBinding)
			if !ok {
				return
			}
			if len(o.Subjects) != 1 || o.Subjects[0].Kind != "ServiceAccount" || "system:serviceaccount:"+o.Subjects[0].Namespace+":"+o.Subjects[0].Name != agentSubject {
				t.Fatalf("the overlay binds %+v, want the agent's service account", o.Subjects)
			}
			o.Subjects = []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: overlayGroup}}
		})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	if strings.Join(kinds, ",") != "ClusterRole,ClusterRoleBinding" {
		t.Fatalf("overlay kinds %v", kinds)
	}
}

// TestKubeClusterScopeOverlay: with clusterScope and the overlay, the
// first target's inventory reports the entry's Pod left in a namespace that
// is no longer a target, and deletes it, while creating Pods stays limited
// to the targets. Without the overlay, clusterScope is refused.
func TestKubeClusterScopeOverlay(t *testing.T) {
	e := newKubeEnv(t)
	const entry = "wide" // the control plane is shared: other tests leave Pods of entry k8s
	ns1, ns2, old := e.namespace("wide-a"), e.namespace("wide-b"), e.namespace("wide-old")
	s3 := kspec("pool-k-left", entry, old, 1)
	if _, err := e.driver(entry, old).Create(tctx(t), s3); err != nil { // as configured before old was removed
		t.Fatal(err)
	}
	s1 := kspec("pool-k-here", entry, ns1, 1)
	if _, err := e.driver(entry, ns1).Create(tctx(t), s1); err != nil {
		t.Fatal(err)
	}
	wideCfg := config.Kubernetes{Image: config.DefaultSquidImage, ClusterScope: true, Profiles: map[string]config.Resources{"small": {CPU: "50m"}}}
	plain := New(e.agent, Options{Entry: entry, Namespace: ns1, Namespaces: []string{ns1, ns2}, Config: wideCfg})
	if _, err := plain.List(tctx(t)); !apierrors.IsForbidden(err) || !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("clusterScope without the overlay: %v, want forbidden", err)
	}
	if v := plain.Check(tctx(t)); v[0].OK {
		t.Fatalf("check with clusterScope without the overlay: %+v, want kubernetes-api failing", v)
	}

	applyOverlay(t, e.admin)
	api := newClient(t, agentConfig(t, overlayGroup))
	d1 := New(api, Options{Entry: entry, Namespace: ns1, Namespaces: []string{ns1, ns2}, Config: wideCfg})
	d2 := New(api, Options{Entry: entry, Namespace: ns2, Namespaces: []string{ns1, ns2}, Config: wideCfg})
	var l1 []agent.Instance
	must(t, poll(10*time.Second, func() error { // RBAC changes reach the authorizer's cache shortly
		var err error
		l1, err = d1.List(tctx(t))
		return err
	}))
	var got []string
	for _, i := range l1 {
		got = append(got, i.ProviderID)
	}
	if want := []string{ns1 + "/" + s1.Name, old + "/" + s3.Name}; !slices.Equal(got, want) && !slices.Equal(got, []string{want[1], want[0]}) {
		t.Fatalf("first target's inventory = %v, want %v", got, want)
	}
	l2, err := d2.List(tctx(t))
	must(t, err)
	if len(l2) != 0 {
		t.Fatalf("second target's inventory = %+v, want empty", l2)
	}
	if v := d1.Check(tctx(t)); !v[0].OK || !strings.Contains(v[0].Detail, "cluster-wide") {
		t.Fatalf("check with the overlay: %+v", v)
	}
	// Garbage collection reaches the Pod through the first target's driver.
	if err := d1.Delete(tctx(t), agent.Ref{ProxyID: s3.ProxyID, ProviderID: old + "/" + s3.Name}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.admin.CoreV1().Pods(old).Get(tctx(t), s3.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the left Pod after delete: %v, want not found", err)
	}
	// The overlay grants no creation outside the targets.
	bare := e.bareNamespace("wide-bare")
	dBare := New(api, Options{Entry: entry, Namespace: bare, Config: wideCfg})
	if _, err := dBare.Create(tctx(t), kspec("pool-k-out", entry, bare, 1)); !apierrors.IsForbidden(err) {
		t.Fatalf("create outside the targets with the overlay: %v, want forbidden", err)
	}
}
