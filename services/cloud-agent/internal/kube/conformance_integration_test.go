//go:build integration

package kube

import (
	"context"
	"maps"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
)

// conformancePageSize is List's page size in the conformance suite: small,
// so its listing spans pages of the API server's continue tokens.
const conformancePageSize = 2

// TestKubeDriverConformance runs the conformance suite against the real
// API server; the test plays the kubelet.
func TestKubeDriverConformance(t *testing.T) {
	shared := newKubeEnv(t)
	// An entry of its own: TestKubeClusterScopeOverlay lists the marked
	// Pods of its entry cluster-wide.
	const entry = "conform"
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			e := &kubeEnv{t: t, admin: shared.admin, agent: shared.agent}
			ns := e.namespace("conform")
			d := e.driver(entry, ns)
			d.pageSize = conformancePageSize
			return agenttest.Backend{
				Driver: d,
				Spec:   func(id string) agent.Spec { return kspec(id, entry, ns, 1) },
				Foreign: func(t *testing.T, name string) func() bool {
					// Someone's Pod named as a proxy's, and a proxy Pod of
					// another entry.
					_, err := e.admin.CoreV1().Pods(ns).Create(tctx(t), restrictedPod(name, map[string]string{"app": "web"}), metav1.CreateOptions{})
					must(t, err)
					other, err := e.driver("other", ns).Create(tctx(t), kspec("pool-k-other", "other", ns, 1))
					must(t, err)
					want := map[string]map[string]string{name: {"app": "web"}, other.Name: markerLabels(other.Marker)}
					return func() bool {
						for n, labels := range want {
							p, err := e.admin.CoreV1().Pods(ns).Get(context.Background(), n, metav1.GetOptions{})
							if err != nil || p.DeletionTimestamp != nil || !maps.Equal(p.Labels, labels) {
								return false
							}
						}
						return true
					}
				},
				Boot: func(t *testing.T, ref agent.Ref) {
					e.setStatus(ns, ref.Name, corev1.PodRunning, "10.244.9.9")
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					e.setStatus(ns, ref.Name, corev1.PodFailed, "")
					return "Pod phase Failed"
				},
			}
		},
		MissingDelete: agent.ErrNotFound,
		PageSize:      conformancePageSize,
	})
}
