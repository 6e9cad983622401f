package config_test

import (
	"testing"

	"proxyfleet/pkg/agentconfig/agentconfigtest"
	"proxyfleet/services/proxmox-agent/internal/config"
)

// FuzzParse: the proxmox-agent's configuration loader
// (agentconfigtest.CheckParse lists the properties), seeded with the
// documented example and this package's test documents.
func FuzzParse(f *testing.F) {
	for _, b := range agentconfigtest.YAMLBlocks(f, "../../../../docs/proxmox.md") {
		f.Add(b)
	}
	f.Add([]byte(good))
	f.Add([]byte(good + "taskPollInterval: 250ms\nrequestTimeout: 2m\nclone: full\ncloneStorage: local-lvm\ncluster: c1\n"))
	f.Add([]byte(good + "caFile: /etc/pve.pem\ninstallGuestAgent: false\nminFreeMiB: 0\n"))
	f.Add([]byte(good + "templates: {debian-13: -1, Bad: 100}\n"))
	f.Add([]byte(good + "requestTimeout: soon\n"))
	f.Add([]byte("nodes: {a: b}\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		agentconfigtest.CheckParse(t, config.Parse, b)
	})
}
