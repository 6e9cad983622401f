package events

import (
	"testing"
	"time"
)

// An applied event carries the public spec: a pool with basic auth has a
// username and no password there, and readers must accept it.
func TestPoolAppliedWithAuthDecodes(t *testing.T) {
	spec := PoolSpec{Name: "demo", Provider: "local", Size: 1, Port: DefaultProxyPort,
		Auth: &ProxyAuth{Username: "crawler", Password: "s3cret"}}
	env, err := NewEnvelope("demo.applied.1", "test", EnvelopeType(AggregatePool, PoolApplied), "demo", time.Now(),
		PoolAppliedData{Spec: spec.Public(), Revision: 1, SecretsDigest: spec.Secrets().Digest([]byte("k"))})
	if err != nil {
		t.Fatal(err)
	}
	var got PoolAppliedData
	if err := env.DecodeData(&got); err != nil {
		t.Fatalf("DecodeData: got %v, want nil", err)
	}
	if got.Spec.Auth == nil || got.Spec.Auth.Username != "crawler" || got.Spec.Auth.Password != "" {
		t.Errorf("auth: got %+v, want username only", got.Spec.Auth)
	}
	bad := PoolAppliedData{Spec: PoolSpec{Name: "demo", Provider: "local", Auth: &ProxyAuth{}}, Revision: 1}
	if err := bad.Validate(); err == nil {
		t.Error("an applied spec with auth but no username: got nil, want an error")
	}
}
