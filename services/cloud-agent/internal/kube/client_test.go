package kube

import (
	"strings"
	"testing"

	"k8s.io/client-go/rest"
)

// TestNewClientRateLimit keeps kubernetes.NewForConfig's rule: a QPS
// without a burst is refused rather than silently unlimited.
func TestNewClientRateLimit(t *testing.T) {
	if _, err := NewClient(&rest.Config{Host: "https://127.0.0.1:6443", QPS: 5}); err == nil || !strings.Contains(err.Error(), "burst") {
		t.Fatalf("QPS without burst: %v, want an error naming the burst", err)
	}
	c, err := NewClient(&rest.Config{Host: "https://127.0.0.1:6443", QPS: 5, Burst: 10})
	if err != nil || c.core == nil || c.authz == nil {
		t.Fatalf("NewClient = %+v, %v", c, err)
	}
}
