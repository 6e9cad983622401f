package kube

import (
	"context"
	"fmt"
	"net/http"
	"time"

	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// Client is the part of the Kubernetes API the driver calls: Pods and
// Secrets (core/v1) and SelfSubjectAccessReviews (authorization.k8s.io/v1).
//
// It is client-go's REST client with a scheme of those two groups only,
// making the requests client-go's generated clients make (protobuf
// preferred, JSON accepted). The generated clientset is not used: it
// links a typed client for every built-in API group and its scheme package
// registers all of them when the program starts, which cost the
// cloud-agent about 17 MB of idle memory (docs/performance.md#memory).
type Client struct {
	core  rest.Interface
	authz rest.Interface
	param runtime.ParameterCodec
}

// NewClient returns a client for the API server rc describes, with the
// defaults of client-go's kubernetes.NewForConfig: its user agent when rc
// sets none, one HTTP transport for both groups, and one rate limiter
// shared by both when rc sets QPS (else each group gets client-go's
// default limiter).
func NewClient(rc *rest.Config) (*Client, error) {
	cfg := *rc
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	hc, err := rest.HTTPClientFor(&cfg)
	if err != nil {
		return nil, err
	}
	if cfg.RateLimiter == nil && cfg.QPS > 0 {
		if cfg.Burst <= 0 {
			return nil, fmt.Errorf("burst is required to be greater than 0 when RateLimiter is not set and QPS is set to greater than 0")
		}
		cfg.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(cfg.QPS, cfg.Burst)
	}
	scheme := runtime.NewScheme()
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := authzv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	codecs := rest.CodecFactoryForGeneratedClient(scheme, serializer.NewCodecFactory(scheme)).WithoutConversion()
	group := func(gv schema.GroupVersion, apiPath string) (rest.Interface, error) {
		c := cfg
		c.GroupVersion, c.APIPath, c.NegotiatedSerializer = &gv, apiPath, codecs
		return rest.RESTClientForConfigAndClient(&c, hc)
	}
	core, err := group(corev1.SchemeGroupVersion, "/api")
	if err != nil {
		return nil, err
	}
	authz, err := group(authzv1.SchemeGroupVersion, "/apis")
	if err != nil {
		return nil, err
	}
	return &Client{core: core, authz: authz, param: runtime.NewParameterCodec(scheme)}, nil
}

// object is a typed API object of a namespaced resource.
type object interface {
	runtime.Object
	GetName() string
}

// resourceClient is one namespaced resource of core/v1 in one namespace
// (metav1.NamespaceAll for lists across namespaces).
type resourceClient[T object, L runtime.Object] struct {
	c         *Client
	name      string
	namespace string
	newObj    func() T
	newList   func() L
}

func (c *Client) pods(namespace string) resourceClient[*corev1.Pod, *corev1.PodList] {
	return resourceClient[*corev1.Pod, *corev1.PodList]{c, "pods", namespace,
		func() *corev1.Pod { return &corev1.Pod{} }, func() *corev1.PodList { return &corev1.PodList{} }}
}

func (c *Client) secrets(namespace string) resourceClient[*corev1.Secret, *corev1.SecretList] {
	return resourceClient[*corev1.Secret, *corev1.SecretList]{c, "secrets", namespace,
		func() *corev1.Secret { return &corev1.Secret{} }, func() *corev1.SecretList { return &corev1.SecretList{} }}
}

func (r resourceClient[T, L]) request(verb string) *rest.Request {
	return r.c.core.Verb(verb).UseProtobufAsDefault().NamespaceIfScoped(r.namespace, r.namespace != "").Resource(r.name)
}

func (r resourceClient[T, L]) Create(ctx context.Context, obj T, opts metav1.CreateOptions) (T, error) {
	out := r.newObj()
	err := r.request(http.MethodPost).VersionedParams(&opts, r.c.param).Body(obj).Do(ctx).Into(out)
	return out, err
}

func (r resourceClient[T, L]) Get(ctx context.Context, name string, opts metav1.GetOptions) (T, error) {
	out := r.newObj()
	err := r.request(http.MethodGet).Name(name).VersionedParams(&opts, r.c.param).Do(ctx).Into(out)
	return out, err
}

func (r resourceClient[T, L]) Update(ctx context.Context, obj T, opts metav1.UpdateOptions) (T, error) {
	out := r.newObj()
	err := r.request(http.MethodPut).Name(obj.GetName()).VersionedParams(&opts, r.c.param).Body(obj).Do(ctx).Into(out)
	return out, err
}

func (r resourceClient[T, L]) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	return r.request(http.MethodDelete).Name(name).Body(&opts).Do(ctx).Error()
}

func (r resourceClient[T, L]) List(ctx context.Context, opts metav1.ListOptions) (L, error) {
	out := r.newList()
	var timeout time.Duration
	if opts.TimeoutSeconds != nil {
		timeout = time.Duration(*opts.TimeoutSeconds) * time.Second
	}
	err := r.request(http.MethodGet).VersionedParams(&opts, r.c.param).Timeout(timeout).Do(ctx).Into(out)
	return out, err
}

// reviewAccess creates a SelfSubjectAccessReview: may this client do what
// review asks?
func (c *Client) reviewAccess(ctx context.Context, review *authzv1.SelfSubjectAccessReview, opts metav1.CreateOptions) (*authzv1.SelfSubjectAccessReview, error) {
	out := &authzv1.SelfSubjectAccessReview{}
	err := c.authz.Post().UseProtobufAsDefault().Resource("selfsubjectaccessreviews").
		VersionedParams(&opts, c.param).Body(review).Do(ctx).Into(out)
	return out, err
}
