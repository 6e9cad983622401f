package config

import (
	"testing"

	"proxyfleet/pkg/agentconfig/agentconfigtest"
)

// FuzzParse: the kvm-agent's configuration loader (agentconfigtest.CheckParse
// lists the properties), seeded with the documented example and this
// package's test documents.
func FuzzParse(f *testing.F) {
	for _, b := range agentconfigtest.YAMLBlocks(f, "../../../../docs/kvm.md") {
		f.Add(b)
	}
	f.Add([]byte(valid))
	f.Add([]byte(valid + "libvirt:\n  ssh: {host: \"kvm1:22\", user: root, keyFile: /k, knownHostsFile: /h}\n  rpcTimeout: 45s\n"))
	f.Add([]byte(valid + "installGuestAgent: false\nvendorData: |\n  #cloud-config\n  runcmd: [true]\nvlan: 4094\ncapacity: 3\n"))
	f.Add([]byte(valid + "images:\n  Debian: {url: ftp://x}\n"))
	f.Add([]byte(valid + "\"a\\nb\": 1\n"))
	f.Add([]byte("entry: kvm-home\n---\ntarget: x\n"))
	f.Add([]byte("{}"))
	f.Fuzz(func(t *testing.T, b []byte) {
		agentconfigtest.CheckParse(t, Parse, b)
	})
}
