package config

import (
	"testing"

	"proxyfleet/pkg/agentconfig/agentconfigtest"
)

// FuzzParse: the cloud-agent's configuration loader
// (agentconfigtest.CheckParse lists the properties), seeded with the
// documented GCE and Kubernetes examples and this package's test document.
func FuzzParse(f *testing.F) {
	agentconfigtest.Fuzz(f, Parse, []string{"../../../../docs/gce.md", "../../../../docs/kubernetes.md"},
		good,
		"entries:\n  - name: k\n    type: kubernetes\n    targets: [ns]\n    kubernetes:\n      image: squid:6\n      nodeSelector: {a: b}\n      imagePullSecrets: [s]\n      profiles: {p: {cpu: 1, memoryLimit: 1Gi}}\n",
		"entries:\n  - name: g\n    type: gce\n    targets: [z]\n    gce: {project: p, endpoint: \"http://[::1]:1\", diskSizeGB: -1}\n    kubernetes: {}\n",
		"entries: []\n",
		"entries:\n  - {name: a, type: gce, commandTimeout: 1}\n  - {name: a}\n",
	)
}
