package config

import (
	"testing"

	"proxyfleet/pkg/agentconfig/agentconfigtest"
)

// FuzzParse: the kvm-agent's configuration loader (agentconfigtest.CheckParse
// lists the properties), seeded with the documented example and this
// package's test documents.
func FuzzParse(f *testing.F) {
	agentconfigtest.Fuzz(f, Parse, []string{"../../../../docs/kvm.md"},
		valid,
		valid+"libvirt:\n  ssh: {host: \"kvm1:22\", user: root, keyFile: /k, knownHostsFile: /h}\n  rpcTimeout: 45s\n",
		valid+"installGuestAgent: false\nvendorData: |\n  #cloud-config\n  runcmd: [true]\nvlan: 4094\ncapacity: 3\n",
		valid+"images:\n  Debian: {url: ftp://x}\n",
		valid+"\"a\\nb\": 1\n",
		"entry: kvm-home\n---\ntarget: x\n",
		"{}",
	)
}
