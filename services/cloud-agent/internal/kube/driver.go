// Package kube is the cloud-agent's Kubernetes backend: an [agent.Driver]
// that runs one Squid Pod per proxy in one namespace, with the proxyfleet
// marker as labels, the Squid configuration and the hashed proxy password
// in a Secret owned by the Pod, and provider IDs "<namespace>/<pod>".
package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"

	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
	"proxyfleet/services/cloud-agent/internal/config"
)

// Marker labels.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "proxyfleet"
	LabelProxy     = "proxyfleet.io/proxy"
	LabelPool      = "proxyfleet.io/pool"
	LabelEntry     = "proxyfleet.io/entry"
	containerName  = "squid"
	listPageSize   = 500
)

// RESTConfig returns the client configuration: the kubeconfig file (and
// context) when one is named, else the in-cluster service account.
func RESTConfig(kubeconfig, kubeContext string) (*rest.Config, error) {
	if kubeconfig == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("in-cluster config: %w; set kubernetes.kubeconfig when running outside a cluster", err)
		}
		return c, nil
	}
	rules := &clientcmd.ClientConfigLoadingRules{ExplicitPath: kubeconfig}
	c, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: kubeContext}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
	}
	return c, nil
}

// Options configure a [Driver].
type Options struct {
	Entry string
	// Namespace is this driver's target.
	Namespace string
	// Namespaces are all targets of the entry. With Config.ClusterScope,
	// the driver of Namespaces[0] also reports marked Pods in namespaces
	// that are no target (left from an earlier config), so garbage
	// collection still reaches them.
	Namespaces []string
	Config     config.Kubernetes
	Log        *slog.Logger
}

// Driver is the Kubernetes [agent.Driver] for one namespace.
type Driver struct {
	api *Client
	o   Options
	log *slog.Logger
	// pageSize is how many Pods one page of List asks for (listPageSize;
	// tests shorten it to list across pages).
	pageSize int64
}

var _ agent.Driver = (*Driver)(nil)

// New returns a driver calling the API through api.
func New(api *Client, o Options) *Driver {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if len(o.Namespaces) == 0 {
		o.Namespaces = []string{o.Namespace}
	}
	if o.Config.Image == "" {
		o.Config.Image = config.DefaultSquidImage
	}
	if o.Config.AuthHelper == "" {
		o.Config.AuthHelper = config.DefaultAuthHelper
	}
	if o.Config.RunAsUser == 0 {
		o.Config.RunAsUser = config.DefaultSquidUser
	}
	return &Driver{api: api, o: o, log: o.Log.With("namespace", o.Namespace), pageSize: listPageSize}
}

// ProviderID returns "<namespace>/<pod>".
func ProviderID(namespace, pod string) string { return namespace + "/" + pod }

func (d *Driver) locate(ref agent.Ref) (namespace, name string, err error) {
	if ref.ProviderID == "" {
		if ref.Name == "" {
			return "", "", agent.Wrapf(agent.ErrPermanent, "reference to proxy %s has neither a provider ID nor a name", ref.ProxyID)
		}
		return d.o.Namespace, ref.Name, nil
	}
	ns, name, ok := strings.Cut(ref.ProviderID, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return "", "", agent.Wrapf(agent.ErrPermanent, "provider ID %q is not <namespace>/<pod>", ref.ProviderID)
	}
	return ns, name, nil
}

func markerLabels(m agent.Marker) map[string]string {
	return map[string]string{LabelManagedBy: ManagedBy, LabelProxy: m.ProxyID, LabelPool: m.Pool, LabelEntry: m.Entry}
}

func markerOf(labels map[string]string) agent.Marker {
	return agent.Marker{ProxyID: labels[LabelProxy], Pool: labels[LabelPool], Entry: labels[LabelEntry]}
}

// Create makes the Pod and its Secret. A Pod of the same name carrying this
// proxy's marker is an earlier attempt's and is adopted; any other is left
// alone and the create fails permanently.
func (d *Driver) Create(ctx context.Context, spec agent.Spec) (agent.Instance, error) {
	for field, v := range map[string]string{"proxy": spec.ProxyID, "pool": spec.Pool, "entry": spec.Entry} {
		if !events.IsIdentifier(v) {
			return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "%s %q cannot be a label value", field, v)
		}
	}
	if spec.Auth != nil && spec.Auth.Password == "" {
		return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "pool %s asks for basic auth without a password", spec.Pool)
	}
	pod, err := d.podFor(spec)
	if err != nil {
		return agent.Instance{}, err
	}
	if len(spec.UserData) > 0 {
		d.log.Debug("the pool's cloud-init user-data does not apply to Pods and is ignored", "proxy", spec.ProxyID)
	}
	pods := d.api.pods(d.o.Namespace)
	got, err := pods.Create(ctx, pod, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		got, err = pods.Get(ctx, spec.Name, metav1.GetOptions{})
		if err != nil {
			return agent.Instance{}, fmt.Errorf("pod %s exists but cannot be read: %w", spec.Name, classify(err))
		}
		if m := markerOf(got.Labels); m != spec.Marker() {
			return agent.Instance{}, agent.Wrapf(agent.ErrPermanent,
				"pod %s/%s exists without the marker of proxy %s (labels say %+v); it is left alone", d.o.Namespace, spec.Name, spec.ProxyID, m)
		}
	} else if err != nil {
		return agent.Instance{}, fmt.Errorf("create pod %s/%s: %w", d.o.Namespace, spec.Name, classify(err))
	}
	if err := d.ensureSecret(ctx, spec, got); err != nil {
		return agent.Instance{}, err
	}
	return d.toInstance(got), nil
}

func (d *Driver) podFor(spec agent.Spec) (*corev1.Pod, error) {
	c := d.o.Config
	image := c.Image
	if spec.Image != "" {
		var err error
		if image, err = agent.Lookup(d.o.Entry, "image", c.Images, spec.Image, ""); err != nil {
			return nil, err
		}
	}
	var res corev1.ResourceRequirements
	if spec.Profile != "" {
		p, err := agent.Lookup(d.o.Entry, "profile", c.Profiles, spec.Profile, "")
		if err != nil {
			return nil, err
		}
		if res, err = resources(p); err != nil {
			return nil, agent.Wrapf(agent.ErrPermanent, "profile %s of entry %s: %w", spec.Profile, d.o.Entry, err)
		}
	}
	port := int32(spec.Port)
	listening := corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(port)}}
	mounts := []corev1.VolumeMount{{Name: "config", MountPath: configDir, ReadOnly: true}}
	volumes := []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{
		Secret: &corev1.SecretVolumeSource{SecretName: spec.Name, DefaultMode: new(int32(0o444))},
	}}}
	// The root filesystem is read-only: Squid may write only to these.
	for _, w := range squidWritableDirs {
		mounts = append(mounts, corev1.VolumeMount{Name: w.volume, MountPath: w.path})
		volumes = append(volumes, corev1.Volume{Name: w.volume, VolumeSource: corev1.VolumeSource{
			EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: new(resource.MustParse("64Mi"))},
		}})
	}
	uid := c.RunAsUser
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: d.o.Namespace, Labels: markerLabels(spec.Marker())},
		Spec: corev1.PodSpec{
			RestartPolicy:      corev1.RestartPolicyAlways,
			ServiceAccountName: c.ServiceAccountName,
			NodeSelector:       c.NodeSelector,
			// The proxy needs no API access.
			AutomountServiceAccountToken: new(false),
			// Pod Security "restricted": non-root with a numeric user,
			// the runtime's default seccomp profile, no privilege gain, no
			// capabilities, a read-only root filesystem.
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: new(true), RunAsUser: &uid, RunAsGroup: &uid, FSGroup: &uid,
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			Containers: []corev1.Container{{
				Name:           containerName,
				Image:          image,
				Command:        []string{"squid", "-N", "-f", configDir + "/" + squidConfKey},
				Ports:          []corev1.ContainerPort{{Name: "proxy", ContainerPort: port, Protocol: corev1.ProtocolTCP}},
				ReadinessProbe: &corev1.Probe{ProbeHandler: listening, PeriodSeconds: 5},
				LivenessProbe: &corev1.Probe{ProbeHandler: listening, InitialDelaySeconds: 10, PeriodSeconds: 10,
					TimeoutSeconds: 3, FailureThreshold: 3},
				Resources: res,
				SecurityContext: &corev1.SecurityContext{
					RunAsNonRoot: new(true), AllowPrivilegeEscalation: new(false), ReadOnlyRootFilesystem: new(true),
					Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
					SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
				},
				VolumeMounts: mounts,
			}},
			Volumes: volumes,
		},
	}
	for _, s := range c.ImagePullSecrets {
		pod.Spec.ImagePullSecrets = append(pod.Spec.ImagePullSecrets, corev1.LocalObjectReference{Name: s})
	}
	return pod, nil
}

func resources(p config.Resources) (corev1.ResourceRequirements, error) {
	var r corev1.ResourceRequirements
	set := func(list *corev1.ResourceList, name corev1.ResourceName, v string) error {
		if v == "" {
			return nil
		}
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return fmt.Errorf("%s %q: %w", name, v, err)
		}
		if *list == nil {
			*list = corev1.ResourceList{}
		}
		(*list)[name] = q
		return nil
	}
	return r, errors.Join(
		set(&r.Requests, corev1.ResourceCPU, p.CPU), set(&r.Requests, corev1.ResourceMemory, p.Memory),
		set(&r.Limits, corev1.ResourceCPU, p.CPULimit), set(&r.Limits, corev1.ResourceMemory, p.MemoryLimit))
}

// ensureSecret writes the Pod's Squid configuration and htpasswd into a
// Secret of the Pod's name, owned by the Pod so it goes with it.
func (d *Driver) ensureSecret(ctx context.Context, spec agent.Spec, pod *corev1.Pod) error {
	data := map[string][]byte{squidConfKey: []byte(squidConf(spec.Name, spec.Port, spec.Auth, d.o.Config.AuthHelper, spec.Egress))}
	if spec.Auth != nil {
		line, err := htpasswd.Line(spec.Auth.Username, spec.Auth.Password)
		if err != nil {
			return agent.Wrapf(agent.ErrPermanent, "basic auth of proxy %s: %w", spec.ProxyID, err)
		}
		data[htpasswdKey] = []byte(line)
	}
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: spec.Name, Namespace: pod.Namespace, Labels: markerLabels(spec.Marker()),
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}},
		},
		Type: corev1.SecretTypeOpaque,
		Data: data,
	}
	secrets := d.api.secrets(pod.Namespace)
	_, err := secrets.Create(ctx, sec, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		old, gerr := secrets.Get(ctx, spec.Name, metav1.GetOptions{})
		if gerr != nil {
			return fmt.Errorf("read secret %s/%s: %w", pod.Namespace, spec.Name, classify(gerr))
		}
		if m := markerOf(old.Labels); m != spec.Marker() {
			return agent.Wrapf(agent.ErrPermanent, "secret %s/%s exists without the marker of proxy %s; it is left alone", pod.Namespace, spec.Name, spec.ProxyID)
		}
		old.Data, old.OwnerReferences = sec.Data, sec.OwnerReferences
		_, err = secrets.Update(ctx, old, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("write secret %s/%s: %w", pod.Namespace, spec.Name, classify(err))
	}
	return nil
}

// Get reads one Pod.
func (d *Driver) Get(ctx context.Context, ref agent.Ref) (agent.Instance, error) {
	ns, name, err := d.locate(ref)
	if err != nil {
		return agent.Instance{}, err
	}
	pod, err := d.api.pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return agent.Instance{}, fmt.Errorf("get pod %s/%s: %w", ns, name, classify(err))
	}
	return d.toInstance(pod), nil
}

// Delete removes the Pod (and its Secret) after checking it carries the
// marker of ref's proxy and this entry. A Pod already terminating is left
// to finish; a Pod already gone is [agent.ErrNotFound].
func (d *Driver) Delete(ctx context.Context, ref agent.Ref) error {
	ns, name, err := d.locate(ref)
	if err != nil {
		return err
	}
	pods := d.api.pods(ns)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		d.deleteSecret(ctx, ns, name, ref.ProxyID)
	}
	if err != nil {
		return fmt.Errorf("get pod %s/%s before delete: %w", ns, name, classify(err))
	}
	m := markerOf(pod.Labels)
	if m.Entry != d.o.Entry || (ref.ProxyID != "" && m.ProxyID != ref.ProxyID) {
		return agent.Wrapf(agent.ErrPermanent, "pod %s/%s does not carry the marker of proxy %s in entry %s (labels say %+v); it is left alone", ns, name, ref.ProxyID, d.o.Entry, m)
	}
	if pod.DeletionTimestamp == nil {
		uid := pod.UID
		err = pods.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete pod %s/%s: %w", ns, name, classify(err))
		}
	}
	d.deleteSecret(ctx, ns, name, m.ProxyID)
	d.log.Info("pod deleted", "pod", name, "proxy", m.ProxyID)
	return nil
}

// deleteSecret removes the Pod's Secret when it carries proxyID's marker.
// The owner reference removes it too; this only makes it prompt.
func (d *Driver) deleteSecret(ctx context.Context, ns, name, proxyID string) {
	secrets := d.api.secrets(ns)
	sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return
	}
	if m := markerOf(sec.Labels); m.Entry != d.o.Entry || (proxyID != "" && m.ProxyID != proxyID) {
		return
	}
	uid := sec.UID
	if err := secrets.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
		d.log.Warn("delete secret; the owner reference will remove it with the pod", "secret", name, "err", err)
	}
}

func (d *Driver) selector() string {
	return LabelEntry + "=" + d.o.Entry + "," + LabelProxy
}

// listScope is the namespace List and Check list Pods in: this target,
// or every namespace with Config.ClusterScope.
func (d *Driver) listScope() (namespace, what string) {
	if d.o.Config.ClusterScope {
		return metav1.NamespaceAll, "cluster-wide"
	}
	return d.o.Namespace, "in " + d.o.Namespace
}

// List returns the marked Pods of this entry in this namespace, by label
// selector, all pages. With Config.ClusterScope it lists every namespace,
// and the entry's first namespace also reports the Pods in namespaces that
// are no target.
func (d *Driver) List(ctx context.Context) ([]agent.Instance, error) {
	var out []agent.Instance
	opts := metav1.ListOptions{LabelSelector: d.selector(), Limit: d.pageSize}
	ns, where := d.listScope()
	for {
		list, err := d.api.pods(ns).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("list pods %s by label %s: %w", where, opts.LabelSelector, classify(err))
		}
		for i := range list.Items {
			p := &list.Items[i]
			if d.owns(p.Namespace) {
				out = append(out, d.toInstance(p))
			}
		}
		if list.Continue == "" {
			break
		}
		opts.Continue = list.Continue
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ProviderID < out[j].ProviderID })
	return out, nil
}

func (d *Driver) owns(ns string) bool {
	return ns == d.o.Namespace || (d.o.Config.ClusterScope && d.o.Namespace == d.o.Namespaces[0] && !slices.Contains(d.o.Namespaces, ns))
}

// Check lists at most one marked Pod where inventory lists them and asks
// the API server whether this agent may create and delete Pods and Secrets
// in its namespace.
func (d *Driver) Check(ctx context.Context) []agent.Verdict {
	ns, where := d.listScope()
	_, err := d.api.pods(ns).List(ctx, metav1.ListOptions{LabelSelector: d.selector(), Limit: 1})
	api := agent.Verdict{Check: "kubernetes-api", OK: err == nil, Detail: "pods listed " + where + " by label"}
	if err != nil {
		api.Detail = classify(err).Error()
	}
	perm := agent.Verdict{Check: "permissions", OK: true, Detail: "may create and delete pods and secrets in " + d.o.Namespace}
	var missing []string
	for _, a := range []struct{ verb, resource string }{{"create", "pods"}, {"delete", "pods"}, {"create", "secrets"}, {"delete", "secrets"}} {
		r, err := d.api.reviewAccess(ctx, &authzv1.SelfSubjectAccessReview{
			Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authzv1.ResourceAttributes{
				Namespace: d.o.Namespace, Verb: a.verb, Resource: a.resource,
			}},
		}, metav1.CreateOptions{})
		switch {
		case err != nil:
			missing = append(missing, a.verb+" "+a.resource+" (review failed: "+classify(err).Error()+")")
		case !r.Status.Allowed:
			missing = append(missing, a.verb+" "+a.resource)
		}
	}
	if len(missing) > 0 {
		perm.OK, perm.Detail = false, "not allowed in "+d.o.Namespace+": "+strings.Join(missing, ", ")
	}
	return []agent.Verdict{api, perm}
}

// toInstance maps a Pod to the agent's view of it: Running with a Pod IP is
// running; Pending, or Running without an IP, is provisioning; Succeeded,
// Failed, Unknown and a Pod being deleted are terminated.
func (d *Driver) toInstance(p *corev1.Pod) agent.Instance {
	out := agent.Instance{Name: p.Name, ProviderID: ProviderID(p.Namespace, p.Name), Marker: markerOf(p.Labels), Detail: string(p.Status.Phase)}
	switch {
	case p.DeletionTimestamp != nil:
		out.State, out.Detail = agent.StateTerminated, "terminating"
	case p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "":
		out.State = agent.StateRunning
		out.Address = net.JoinHostPort(p.Status.PodIP, strconv.Itoa(int(proxyPort(p))))
	case p.Status.Phase == corev1.PodRunning:
		out.State, out.Detail = agent.StateProvisioning, "Running without a Pod IP yet"
	case p.Status.Phase == corev1.PodSucceeded, p.Status.Phase == corev1.PodFailed, p.Status.Phase == corev1.PodUnknown:
		// Containers restart inside a running Pod; a Pod that ended
		// (evicted, its node lost) stays ended.
		out.State = agent.StateTerminated
		out.Detail = "Pod phase " + string(p.Status.Phase)
		if p.Status.Reason != "" || p.Status.Message != "" {
			out.Detail += ": " + strings.TrimSpace(p.Status.Reason+" "+p.Status.Message)
		}
	default:
		out.State = agent.StateProvisioning
	}
	return out
}

func proxyPort(p *corev1.Pod) int32 {
	for _, c := range p.Spec.Containers {
		for _, port := range c.Ports {
			if port.Name == "proxy" {
				return port.ContainerPort
			}
		}
	}
	return events.DefaultProxyPort
}
