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
	agentconfigtest.Fuzz(f, config.Parse, []string{"../../../../docs/proxmox.md"},
		good,
		good+"taskPollInterval: 250ms\nrequestTimeout: 2m\nclone: full\ncloneStorage: local-lvm\ncluster: c1\n",
		good+"caFile: /etc/pve.pem\ninstallGuestAgent: false\nminFreeMiB: 0\n",
		good+"templates: {debian-13: -1, Bad: 100}\n",
		good+"requestTimeout: soon\n",
		"nodes: {a: b}\n",
	)
}
