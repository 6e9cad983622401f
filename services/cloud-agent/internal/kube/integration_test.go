//go:build integration

package kube

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
	"proxyfleet/services/cloud-agent/internal/config"
)

const rbacManifest = "../../../../deploy/kubernetes/rbac.yaml"

// agentSubject is the service account rbac.yaml grants the agent's rights to.
const agentSubject = "system:serviceaccount:proxyfleet:cloud-agent"

type kubeEnv struct {
	t     *testing.T
	admin clientset // typed calls, for setting up and inspecting
	agent *Client   // the driver's client, impersonating the agent's service account
}

// clientset gives the tests the typed calls of client-go's generated
// clientset they make (Get, List, Create, Update, UpdateStatus and Delete
// on the resources below), through the dynamic client and the
// unstructured converter. The generated clients, even of three API
// groups, would have this tier compile under the race detector about 140
// packages no other test needs (every API group's types, for their
// scheme); the dynamic client needs three.
type clientset struct{ dyn dynamic.Interface }

func newClientset(t *testing.T, cfg *rest.Config) clientset {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	must(t, err)
	return clientset{dyn: dyn}
}

func (c clientset) CoreV1() coreV1                   { return coreV1(c) }
func (c clientset) RbacV1() rbacV1                   { return rbacV1(c) }
func (c clientset) AuthorizationV1() authorizationV1 { return authorizationV1(c) }

type (
	coreV1          clientset
	rbacV1          clientset
	authorizationV1 clientset
)

func (c coreV1) Pods(ns string) typedClient[corev1.Pod, corev1.PodList] {
	return resourceOf[corev1.Pod, corev1.PodList](c.dyn, "v1", "Pod", "pods", ns)
}
func (c coreV1) Secrets(ns string) typedClient[corev1.Secret, corev1.SecretList] {
	return resourceOf[corev1.Secret, corev1.SecretList](c.dyn, "v1", "Secret", "secrets", ns)
}
func (c coreV1) ConfigMaps(ns string) typedClient[corev1.ConfigMap, corev1.ConfigMapList] {
	return resourceOf[corev1.ConfigMap, corev1.ConfigMapList](c.dyn, "v1", "ConfigMap", "configmaps", ns)
}
func (c coreV1) ServiceAccounts(ns string) typedClient[corev1.ServiceAccount, corev1.ServiceAccountList] {
	return resourceOf[corev1.ServiceAccount, corev1.ServiceAccountList](c.dyn, "v1", "ServiceAccount", "serviceaccounts", ns)
}
func (c coreV1) ResourceQuotas(ns string) typedClient[corev1.ResourceQuota, corev1.ResourceQuotaList] {
	return resourceOf[corev1.ResourceQuota, corev1.ResourceQuotaList](c.dyn, "v1", "ResourceQuota", "resourcequotas", ns)
}
func (c coreV1) Namespaces() typedClient[corev1.Namespace, corev1.NamespaceList] {
	return resourceOf[corev1.Namespace, corev1.NamespaceList](c.dyn, "v1", "Namespace", "namespaces", "")
}
func (c coreV1) Nodes() typedClient[corev1.Node, corev1.NodeList] {
	return resourceOf[corev1.Node, corev1.NodeList](c.dyn, "v1", "Node", "nodes", "")
}

func (c rbacV1) Roles(ns string) typedClient[rbacv1.Role, rbacv1.RoleList] {
	return resourceOf[rbacv1.Role, rbacv1.RoleList](c.dyn, "rbac.authorization.k8s.io/v1", "Role", "roles", ns)
}
func (c rbacV1) RoleBindings(ns string) typedClient[rbacv1.RoleBinding, rbacv1.RoleBindingList] {
	return resourceOf[rbacv1.RoleBinding, rbacv1.RoleBindingList](c.dyn, "rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", ns)
}
func (c rbacV1) ClusterRoles() typedClient[rbacv1.ClusterRole, rbacv1.ClusterRoleList] {
	return resourceOf[rbacv1.ClusterRole, rbacv1.ClusterRoleList](c.dyn, "rbac.authorization.k8s.io/v1", "ClusterRole", "clusterroles", "")
}
func (c rbacV1) ClusterRoleBindings() typedClient[rbacv1.ClusterRoleBinding, rbacv1.ClusterRoleBindingList] {
	return resourceOf[rbacv1.ClusterRoleBinding, rbacv1.ClusterRoleBindingList](c.dyn, "rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "clusterrolebindings", "")
}

func (c authorizationV1) SubjectAccessReviews() typedClient[authorizationv1.SubjectAccessReview, struct{}] {
	return resourceOf[authorizationv1.SubjectAccessReview, struct{}](c.dyn, "authorization.k8s.io/v1", "SubjectAccessReview", "subjectaccessreviews", "")
}

// typedClient is one resource (in one namespace, or all, or
// cluster-scoped) with the typed methods of client-go's generated
// clients: T is the object, L its list.
type typedClient[T, L any] struct {
	r                dynamic.ResourceInterface
	apiVersion, kind string
}

func resourceOf[T, L any](dyn dynamic.Interface, apiVersion, kind, resource, ns string) typedClient[T, L] {
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		panic(err)
	}
	nr := dyn.Resource(gv.WithResource(resource))
	var r dynamic.ResourceInterface = nr
	if ns != "" {
		r = nr.Namespace(ns)
	}
	return typedClient[T, L]{r: r, apiVersion: apiVersion, kind: kind}
}

func (c typedClient[T, L]) Get(ctx context.Context, name string, opts metav1.GetOptions) (*T, error) {
	return typed[T](c.r.Get(ctx, name, opts))
}

func (c typedClient[T, L]) List(ctx context.Context, opts metav1.ListOptions) (*L, error) {
	u, err := c.r.List(ctx, opts)
	if err != nil {
		return nil, err
	}
	out := new(L)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.UnstructuredContent(), out); err != nil {
		return nil, err
	}
	return out, nil
}

func (c typedClient[T, L]) Create(ctx context.Context, obj *T, opts metav1.CreateOptions) (*T, error) {
	return c.write(obj, func(u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return c.r.Create(ctx, u, opts)
	})
}

func (c typedClient[T, L]) Update(ctx context.Context, obj *T, opts metav1.UpdateOptions) (*T, error) {
	return c.write(obj, func(u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return c.r.Update(ctx, u, opts)
	})
}

func (c typedClient[T, L]) UpdateStatus(ctx context.Context, obj *T, opts metav1.UpdateOptions) (*T, error) {
	return c.write(obj, func(u *unstructured.Unstructured) (*unstructured.Unstructured, error) {
		return c.r.UpdateStatus(ctx, u, opts)
	})
}

// write sends obj, with its apiVersion and kind, through op and decodes
// what the API answers.
func (c typedClient[T, L]) write(obj *T, op func(*unstructured.Unstructured) (*unstructured.Unstructured, error)) (*T, error) {
	u, err := c.unstructured(obj)
	if err != nil {
		return nil, err
	}
	return typed[T](op(u))
}

func (c typedClient[T, L]) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	return c.r.Delete(ctx, name, opts)
}

// unstructured is obj with its apiVersion and kind, which the generated
// clients' encoder would have set.
func (c typedClient[T, L]) unstructured(obj *T) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(c.apiVersion)
	u.SetKind(c.kind)
	return u, nil
}

func typed[T any](u *unstructured.Unstructured, err error) (*T, error) {
	if err != nil {
		return nil, err
	}
	out := new(T)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out); err != nil {
		return nil, err
	}
	return out, nil
}

// agentGroups are the groups of the agent's service account.
var agentGroups = []string{"system:serviceaccounts", "system:serviceaccounts:proxyfleet", "system:authenticated"}

func newKubeEnv(t *testing.T) *kubeEnv {
	t.Helper()
	cfg := adminConfig(t)
	admin := newClientset(t, cfg)
	applyRBAC(t, admin)
	return &kubeEnv{t: t, admin: admin, agent: newClient(t, agentConfig(t))}
}

// agentConfig is the admin config impersonating the agent's service
// account (with extra groups when given).
func agentConfig(t *testing.T, extraGroups ...string) *rest.Config {
	ac := adminConfig(t)
	ac.Impersonate = rest.ImpersonationConfig{UserName: agentSubject, Groups: append(slices.Clone(agentGroups), extraGroups...)}
	return ac
}

func newClient(t *testing.T, cfg *rest.Config) *Client {
	t.Helper()
	c, err := NewClient(cfg)
	must(t, err)
	return c
}

// manifestDocs returns the YAML documents of a manifest file as JSON.
func manifestDocs(t *testing.T, path string) []json.RawMessage {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := yamlutil.NewYAMLOrJSONDecoder(f, 4096)
	var docs []json.RawMessage
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			return docs
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		docs = append(docs, raw)
	}
}

// shippedRole returns the Role and RoleBinding of rbac.yaml: the rights
// the agent holds in each target namespace.
func shippedRole(t *testing.T) (rbacv1.Role, rbacv1.RoleBinding) {
	t.Helper()
	var role rbacv1.Role
	var binding rbacv1.RoleBinding
	for _, raw := range manifestDocs(t, rbacManifest) {
		var meta metav1.TypeMeta
		must(t, json.Unmarshal(raw, &meta))
		switch meta.Kind {
		case "Role":
			must(t, json.Unmarshal(raw, &role))
		case "RoleBinding":
			must(t, json.Unmarshal(raw, &binding))
		}
	}
	if role.Name == "" || binding.Name == "" {
		t.Fatal("rbac.yaml has no Role or no RoleBinding")
	}
	return role, binding
}

// applyRBAC creates the objects of deploy/kubernetes/rbac.yaml (or of the
// manifest at path), so every test runs with exactly the rights the
// shipped manifest grants.
func applyRBAC(t *testing.T, cs clientset, path ...string) {
	t.Helper()
	file := rbacManifest
	if len(path) > 0 {
		file = path[0]
	}
	ctx := context.Background()
	for _, raw := range manifestDocs(t, file) {
		var meta metav1.TypeMeta
		_ = json.Unmarshal(raw, &meta)
		if err := createObject(ctx, t, cs, file, meta.Kind, raw, nil); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("apply %s: %v", meta.Kind, err)
		}
	}
}

// createObject creates raw, a document of kind from the manifest file,
// with cs and returns the API's error; edit, when not nil, sees (and may
// change) the decoded object first. A kind the manifests do not use fails
// the test.
func createObject(ctx context.Context, t *testing.T, cs clientset, file, kind string, raw []byte, edit func(obj any)) error {
	t.Helper()
	opts := metav1.CreateOptions{}
	switch kind {
	case "Namespace":
		return decodeCreate(t, raw, edit, func(o *corev1.Namespace) error {
			_, err := cs.CoreV1().Namespaces().Create(ctx, o, opts)
			return err
		})
	case "ServiceAccount":
		return decodeCreate(t, raw, edit, func(o *corev1.ServiceAccount) error {
			_, err := cs.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, opts)
			return err
		})
	case "ClusterRole":
		return decodeCreate(t, raw, edit, func(o *rbacv1.ClusterRole) error {
			_, err := cs.RbacV1().ClusterRoles().Create(ctx, o, opts)
			return err
		})
	case "ClusterRoleBinding":
		return decodeCreate(t, raw, edit, func(o *rbacv1.ClusterRoleBinding) error {
			_, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, o, opts)
			return err
		})
	case "Role":
		return decodeCreate(t, raw, edit, func(o *rbacv1.Role) error {
			_, err := cs.RbacV1().Roles(o.Namespace).Create(ctx, o, opts)
			return err
		})
	case "RoleBinding":
		return decodeCreate(t, raw, edit, func(o *rbacv1.RoleBinding) error {
			_, err := cs.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, opts)
			return err
		})
	}
	t.Fatalf("%s: unexpected kind %q", file, kind)
	return nil
}

// decodeCreate decodes raw into a T, lets edit (if any) see it, and
// creates it with create.
func decodeCreate[T any](t *testing.T, raw []byte, edit func(obj any), create func(*T) error) error {
	t.Helper()
	var o T
	must(t, json.Unmarshal(raw, &o))
	if edit != nil {
		edit(&o)
	}
	return create(&o)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// restricted labels a namespace to enforce Pod Security "restricted".
var restricted = map[string]string{"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}

// namespace creates a fresh target namespace enforcing Pod Security
// "restricted", with the "default" service account the ServiceAccount
// admission plugin expects (no controller manager runs) and the shipped
// Role and RoleBinding of rbac.yaml bound in it.
func (e *kubeEnv) namespace(prefix string) string {
	e.t.Helper()
	ns := e.bareNamespace(prefix)
	role, binding := shippedRole(e.t)
	role.Namespace, binding.Namespace = ns, ns
	ctx := context.Background()
	_, err := e.admin.RbacV1().Roles(ns).Create(ctx, &role, metav1.CreateOptions{})
	must(e.t, err)
	_, err = e.admin.RbacV1().RoleBindings(ns).Create(ctx, &binding, metav1.CreateOptions{})
	must(e.t, err)
	e.waitAllowed(ns)
	return ns
}

// waitAllowed waits until the apiserver's authorizer lets the agent create
// Pods in ns: it learns of a new RoleBinding through its own watch, a
// moment after the create returned (longer on a loaded machine).
func (e *kubeEnv) waitAllowed(ns string) {
	e.t.Helper()
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User: agentSubject, Groups: agentGroups,
		ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: ns, Verb: "create", Resource: "pods"},
	}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, err := e.admin.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), review, metav1.CreateOptions{})
		if err == nil && got.Status.Allowed {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("the agent may still not create pods in %s 30s after its RoleBinding: %v %+v", ns, err, got)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// bareNamespace creates a restricted namespace where the agent holds no right.
func (e *kubeEnv) bareNamespace(prefix string) string {
	e.t.Helper()
	ctx := context.Background()
	ns, err := e.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-", Labels: restricted}}, metav1.CreateOptions{})
	must(e.t, err)
	_, err = e.admin.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	must(e.t, err)
	return ns.Name
}

// restrictedPod is a Pod that Pod Security "restricted" admits.
func restrictedPod(name string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			SecurityContext: &corev1.PodSecurityContext{RunAsNonRoot: new(true), RunAsUser: new(int64(1000)),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			Containers: []corev1.Container{{Name: "web", Image: "nginx:1.27", SecurityContext: &corev1.SecurityContext{
				AllowPrivilegeEscalation: new(false), Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			}}},
		},
	}
}

// driver returns a driver for ns; targets are all the entry's namespaces
// (default: ns alone).
func (e *kubeEnv) driver(entry, ns string, targets ...string) *Driver {
	if len(targets) == 0 {
		targets = []string{ns}
	}
	return New(e.agent, Options{Entry: entry, Namespace: ns, Namespaces: targets, Config: config.Kubernetes{
		Image: config.DefaultSquidImage, Profiles: map[string]config.Resources{"small": {CPU: "50m", Memory: "64Mi"}},
	}})
}

// setRunning plays the kubelet: the Pod runs, with ip when not empty.
// setStatus plays the kubelet: it sets the Pod's phase and address. The
// agent records provisioning before it creates the Pod (write-ahead), so a
// caller that waited for that event may arrive before the Pod exists; it
// waits for the Pod, and retries when the driver updated it meanwhile.
func (e *kubeEnv) setStatus(ns, name string, phase corev1.PodPhase, ip string) {
	e.t.Helper()
	ctx := context.Background()
	must(e.t, poll(60*time.Second, func() error {
		pod, err := e.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return err
		}
		if err != nil {
			e.t.Fatalf("get pod %s/%s: %v", ns, name, err)
		}
		pod.Status.Phase = phase
		pod.Status.PodIP = ip
		pod.Status.PodIPs = nil
		if ip != "" {
			pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
		}
		_, err = e.admin.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			return err
		}
		if err != nil {
			e.t.Fatalf("update status of pod %s/%s: %v", ns, name, err)
		}
		return nil
	}))
}

func kspec(id, entry, ns string, attempt int) agent.Spec {
	return agent.Spec{ProxyID: id, Pool: "pool-k", Entry: entry, Target: ns, Name: events.InstanceName(id), Attempt: attempt,
		Port: 3128, Profile: "small", Auth: &events.ProxyAuth{Username: "crawler", Password: "pw-canary-9f8e7d"}}
}

// createOne creates the proxy id of entry k8s in a new namespace named
// after prefix, and returns its driver, namespace, spec and reference.
func (e *kubeEnv) createOne(prefix, id string) (d *Driver, ns string, s agent.Spec, ref agent.Ref) {
	e.t.Helper()
	ns = e.namespace(prefix)
	d = e.driver("k8s", ns)
	s = kspec(id, "k8s", ns, 1)
	inst, err := d.Create(tctx(e.t), s)
	must(e.t, err)
	return d, ns, s, agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: inst.ProviderID}
}

func tctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestKubeLifecycleAcrossNamespaces(t *testing.T) {
	e := newKubeEnv(t)
	ns1, ns2, old := e.namespace("life-a"), e.namespace("life-b"), e.namespace("life-old")
	d1, d2 := e.driver("k8s", ns1, ns1, ns2), e.driver("k8s", ns2, ns1, ns2)
	dOld := e.driver("k8s", old) // as configured before old was removed from the targets

	s1, s2, s3 := kspec("pool-k-one", "k8s", ns1, 1), kspec("pool-k-two", "k8s", ns2, 1), kspec("pool-k-old", "k8s", old, 1)
	inst, err := d1.Create(tctx(t), s1)
	if err != nil {
		t.Fatal(err)
	}
	if inst.State != agent.StateProvisioning || inst.ProviderID != ns1+"/"+s1.Name || inst.Marker != s1.Marker() {
		t.Fatalf("created: %+v", inst)
	}
	if _, err := d2.Create(tctx(t), s2); err != nil {
		t.Fatal(err)
	}
	if _, err := dOld.Create(tctx(t), s3); err != nil {
		t.Fatal(err)
	}
	// Unmarked Pods and Pods of another entry are never listed.
	other := e.driver("other", ns1)
	if _, err := other.Create(tctx(t), kspec("pool-k-foreign", "other", ns1, 1)); err != nil {
		t.Fatal(err)
	}

	pod, err := e.admin.CoreV1().Pods(ns1).Get(tctx(t), s1.Name, metav1.GetOptions{})
	must(t, err)
	sec, err := e.admin.CoreV1().Secrets(ns1).Get(tctx(t), s1.Name, metav1.GetOptions{})
	must(t, err)
	if len(sec.OwnerReferences) != 1 || sec.OwnerReferences[0].UID != pod.UID {
		t.Fatalf("secret owner = %+v, want the pod %s", sec.OwnerReferences, pod.UID)
	}
	if !htpasswd.Verify(sec.Data[htpasswdKey], "crawler", "pw-canary-9f8e7d") || !strings.Contains(string(sec.Data[squidConfKey]), "http_port 3128") {
		t.Fatalf("secret data = %q", sec.Data)
	}
	podJSON, _ := json.Marshal(pod)
	secJSON, _ := json.Marshal(sec)
	if strings.Contains(string(podJSON), "pw-canary") || strings.Contains(string(secJSON), "pw-canary") {
		t.Fatal("the proxy password is stored in the clear")
	}

	names := func(list []agent.Instance) string {
		var out []string
		for _, i := range list {
			out = append(out, i.ProviderID)
		}
		return strings.Join(out, ",")
	}
	// Namespaced by default: each target lists its own namespace, and the
	// Pod left in a namespace that is no longer a target is in no
	// inventory (TestKubeClusterScopeOverlay reaches it).
	l1, err := d1.List(tctx(t))
	must(t, err)
	if got := names(l1); got != ns1+"/"+s1.Name {
		t.Fatalf("first target's inventory = %s, want %s/%s alone", got, ns1, s1.Name)
	}
	l2, err := d2.List(tctx(t))
	must(t, err)
	if got := names(l2); got != ns2+"/"+s2.Name {
		t.Fatalf("second target's inventory = %s, want %s/%s", got, ns2, s2.Name)
	}

	ref := agent.Ref{ProxyID: s1.ProxyID, Name: s1.Name, ProviderID: inst.ProviderID}
	e.setStatus(ns1, s1.Name, corev1.PodRunning, "10.244.1.7")
	got, err := d1.Get(tctx(t), ref)
	must(t, err)
	if got.State != agent.StateRunning || got.Address != "10.244.1.7:3128" {
		t.Fatalf("running pod = %+v", got)
	}
	if err := d1.Delete(tctx(t), ref); err != nil {
		t.Fatal(err)
	}
	if _, err := e.admin.CoreV1().Secrets(ns1).Get(tctx(t), s1.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("secret after delete: %v, want not found", err)
	}
}

// TestKubeForeignPodIsLeftAlone: a Pod of the same name without our marker
// is never adopted or deleted (an existing marked Pod is adopted: the
// conformance suite's CreateIsIdempotent).
func TestKubeForeignPodIsLeftAlone(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("exists")
	d := e.driver("k8s", ns)
	foreign := kspec("pool-k-foreign", "k8s", ns, 1)
	_, err := e.admin.CoreV1().Pods(ns).Create(tctx(t), restrictedPod(foreign.Name, map[string]string{"app": "web"}), metav1.CreateOptions{})
	must(t, err)
	if _, err := d.Create(tctx(t), foreign); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("create over a foreign pod: %v, want ErrPermanent", err)
	}
	if err := d.Delete(tctx(t), agent.Ref{ProxyID: foreign.ProxyID, Name: foreign.Name}); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("delete of a foreign pod: %v, want ErrPermanent", err)
	}
	if _, err := e.admin.CoreV1().Pods(ns).Get(tctx(t), foreign.Name, metav1.GetOptions{}); err != nil {
		t.Fatalf("foreign pod: %v", err)
	}
}

func TestKubePodWithoutIPStaysProvisioning(t *testing.T) {
	e := newKubeEnv(t)
	d, ns, s, ref := e.createOne("noip", "pool-k-noip")
	cases := []struct {
		phase corev1.PodPhase
		ip    string
		want  agent.State
	}{
		{corev1.PodPending, "", agent.StateProvisioning},
		{corev1.PodRunning, "", agent.StateProvisioning},
		{corev1.PodFailed, "", agent.StateTerminated},
	}
	for _, c := range cases {
		e.setStatus(ns, s.Name, c.phase, c.ip)
		got, err := d.Get(tctx(t), ref)
		must(t, err)
		if got.State != c.want || got.Address != "" {
			t.Fatalf("phase %s ip %q: %+v, want %s without address", c.phase, c.ip, got, c.want)
		}
	}
}

func TestKubeDeleteWhileTerminating(t *testing.T) {
	e := newKubeEnv(t)
	d, ns, s, ref := e.createOne("term", "pool-k-term")
	// A finalizer holds the Pod in Terminating, as a kubelet stopping its
	// containers would.
	const hold = "proxyfleet.test/hold"
	pod, err := e.admin.CoreV1().Pods(ns).Get(tctx(t), s.Name, metav1.GetOptions{})
	must(t, err)
	pod.Finalizers = append(pod.Finalizers, hold)
	_, err = e.admin.CoreV1().Pods(ns).Update(tctx(t), pod, metav1.UpdateOptions{})
	must(t, err)

	if err := d.Delete(tctx(t), ref); err != nil {
		t.Fatal(err)
	}
	got, err := d.Get(tctx(t), ref)
	must(t, err)
	if got.State != agent.StateTerminated || got.Detail != "terminating" {
		t.Fatalf("terminating pod = %+v", got)
	}
	if err := d.Delete(tctx(t), ref); err != nil {
		t.Fatalf("delete while terminating: %v, want success", err)
	}
	pod, err = e.admin.CoreV1().Pods(ns).Get(tctx(t), s.Name, metav1.GetOptions{})
	must(t, err)
	pod.Finalizers = nil
	_, err = e.admin.CoreV1().Pods(ns).Update(tctx(t), pod, metav1.UpdateOptions{})
	must(t, err)
	if err := poll(30*time.Second, func() error {
		_, err := d.Get(tctx(t), ref)
		if errors.Is(err, agent.ErrNotFound) {
			return nil
		}
		return errors.New("pod still there")
	}); err != nil {
		t.Fatal(err)
	}
}

func TestKubeQuotaIsQuota(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("quota")
	q, err := e.admin.CoreV1().ResourceQuotas(ns).Create(tctx(t), &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Name: "no-pods"},
		Spec:       corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("0")}},
	}, metav1.CreateOptions{})
	must(t, err)
	// No controller manager runs: publish the quota's status as it would.
	q.Status = corev1.ResourceQuotaStatus{Hard: q.Spec.Hard, Used: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("0")}}
	_, err = e.admin.CoreV1().ResourceQuotas(ns).UpdateStatus(tctx(t), q, metav1.UpdateOptions{})
	must(t, err)
	d := e.driver("k8s", ns)
	if _, err := d.Create(tctx(t), kspec("pool-k-quota", "k8s", ns, 1)); !errors.Is(err, agent.ErrQuotaExceeded) {
		t.Fatalf("create over quota: %v (class %s), want ErrQuotaExceeded", err, agent.Classify(err))
	}
}

func TestKubeCheck(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("check")
	v := e.driver("k8s", ns).Check(tctx(t))
	if len(v) != 2 || !v[0].OK || !v[1].OK {
		t.Fatalf("check with the shipped RBAC = %+v, want all ok", v)
	}
	cfg := adminConfig(t)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "nobody", Groups: []string{"system:authenticated"}}
	d := New(newClient(t, cfg), Options{Entry: "k8s", Namespace: ns})
	v = d.Check(tctx(t))
	if v[0].OK || v[1].OK || !strings.Contains(v[1].Detail, "create pods") {
		t.Fatalf("check without rights = %+v, want both failing", v)
	}
}

// TestKubeEndToEnd runs two proxies through NATS, the agent runtime and the
// driver against the real API server; the test plays the kubelet by setting
// each Pod's status.
func TestKubeEndToEnd(t *testing.T) {
	e := newKubeEnv(t)
	ns := e.namespace("e2e")
	d := e.driver("k8s", ns)
	var logs strings.Builder
	var logMu sync.Mutex
	log := slog.New(slog.NewJSONHandler(writerFunc(func(p []byte) (int, error) {
		logMu.Lock()
		defer logMu.Unlock()
		return logs.Write(p)
	}), &slog.HandlerOptions{Level: slog.LevelDebug}))
	d.log = log
	conn := bustest.Start(t)
	rt, err := agent.New(bustest.Dial(t, conn), d, agent.Config{
		Info:          agent.Info{Entry: "k8s", Target: ns, Type: "kubernetes"},
		WatchInterval: 50 * time.Millisecond, HeartbeatInterval: 500 * time.Millisecond,
	}, log, nil)
	must(t, err)
	agenttest.Serve(t, rt.Run)

	store := bus.NewEventStore(conn, "test", nil)
	ids := []string{"pool-k-e2e1", "pool-k-e2e2"}
	for _, id := range ids {
		cmd := events.CreateCommand{
			ProxyID:   id,
			ProxySpec: events.ProxySpec{Pool: "pool-k", Entry: "k8s", Target: ns, Instance: events.InstanceName(id), Port: 3128},
			Attempt:   1,
			Auth:      &events.ProxyAuth{Username: "crawler", Password: "pw-e2e-canary"},
			UserData:  []byte("#cloud-config\n# ud-e2e-canary\n"),
		}
		_, err := bus.PublishCreate(context.Background(), conn, "test", cmd, 0)
		must(t, err)
	}
	for i, id := range ids {
		name := events.InstanceName(id)
		must(t, poll(30*time.Second, func() error {
			_, err := e.admin.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
			return err
		}))
		bustest.WaitEvent(t, 60*time.Second, store, id, events.ProxyProvisioning)
		e.setStatus(ns, name, corev1.PodRunning, "10.244.2."+string(rune('1'+i)))
	}
	for i, id := range ids {
		ev := bustest.WaitEvent(t, 60*time.Second, store, id, events.ProxyRunning)
		var run events.ProxyRunningData
		must(t, ev.DecodeData(&run))
		if want := "10.244.2." + string(rune('1'+i)) + ":3128"; run.Address != want || run.ProviderID != ns+"/"+events.InstanceName(id) {
			t.Fatalf("%s running %+v, want address %s", id, run, want)
		}
		cmd := events.DeleteCommand{ProxyID: id, Pool: "pool-k", Entry: "k8s", Target: ns, Instance: events.InstanceName(id),
			ProviderID: run.ProviderID, Attempt: 1}
		_, err := bus.PublishDelete(context.Background(), conn, "test", cmd, 0)
		must(t, err)
	}
	for _, id := range ids {
		bustest.WaitEvent(t, 60*time.Second, store, id, events.ProxyDeleted)
	}
	pods, err := e.admin.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	must(t, err)
	secrets, err := e.admin.CoreV1().Secrets(ns).List(context.Background(), metav1.ListOptions{LabelSelector: LabelProxy})
	must(t, err)
	if len(pods.Items) != 0 || len(secrets.Items) != 0 {
		t.Fatalf("%d pods and %d secrets left after deleting the pool", len(pods.Items), len(secrets.Items))
	}
	logMu.Lock()
	out := logs.String()
	logMu.Unlock()
	if !strings.Contains(out, "pod deleted") {
		t.Fatalf("no driver logs captured:\n%s", out)
	}
	for _, secret := range []string{"pw-e2e-canary", "ud-e2e-canary", "$2y$"} {
		if strings.Contains(out, secret) {
			t.Errorf("%q appears in the debug logs", secret)
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
