package config

import (
	"testing"

	"proxyfleet/pkg/agentconfig/agentconfigtest"
)

// FuzzParse: the cloud-agent's configuration loader
// (agentconfigtest.CheckParse lists the properties), seeded with the
// documented GCE and Kubernetes examples and this package's test document.
func FuzzParse(f *testing.F) {
	for _, doc := range []string{"../../../../docs/gce.md", "../../../../docs/kubernetes.md"} {
		for _, b := range agentconfigtest.YAMLBlocks(f, doc) {
			f.Add(b)
		}
	}
	f.Add([]byte(good))
	f.Add([]byte("entries:\n  - name: k\n    type: kubernetes\n    targets: [ns]\n    kubernetes:\n      image: squid:6\n      nodeSelector: {a: b}\n      imagePullSecrets: [s]\n      profiles: {p: {cpu: 1, memoryLimit: 1Gi}}\n"))
	f.Add([]byte("entries:\n  - name: g\n    type: gce\n    targets: [z]\n    gce: {project: p, endpoint: \"http://[::1]:1\", diskSizeGB: -1}\n    kubernetes: {}\n"))
	f.Add([]byte("entries: []\n"))
	f.Add([]byte("entries:\n  - {name: a, type: gce, commandTimeout: 1}\n  - {name: a}\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		agentconfigtest.CheckParse(t, Parse, b)
	})
}
