package config_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	"proxyfleet/services/proxmox-agent/internal/config"
)

const good = `
entry: pve-home
apiURL: https://192.168.0.8:8006
tokenFile: /etc/proxyfleet/pve-token
fingerprint: "AA:BB:CC:DD:EE:FF:00:11:22:33:44:55:66:77:88:99:AA:BB:CC:DD:EE:FF:00:11:22:33:44:55:66:77:88:99"
nodes: [pve1, pve2]
templates:
  debian-13: 9000
seedsStorage: proxy-seeds
bridge: vmbr0
vlanTag: 4
profiles:
  small: {cores: 1, memoryMiB: 1024}
`

func TestParseGood(t *testing.T) {
	c, err := config.Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.Cluster != "pve-home" || c.Clone != config.CloneLinked || c.VLANTag != 4 || !c.GuestAgent() || c.MinFreeMiB != 1024 {
		t.Errorf("defaults not applied: %+v", c)
	}
	if time.Duration(c.TaskPollInterval) != time.Second || time.Duration(c.RequestTimeout) != time.Minute {
		t.Errorf("taskPollInterval, requestTimeout = %v, %v; want the defaults 1s, 1m",
			time.Duration(c.TaskPollInterval), time.Duration(c.RequestTimeout))
	}
	if c.LabelsOf("pve1") != nil {
		t.Errorf("labels of pve1 = %v, want none", c.LabelsOf("pve1"))
	}
	c, err = config.Parse([]byte(good + "labels: {provider: pve-home, country: de}\nnodeLabels: {pve2: {country: fr, rack: r2}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.LabelsOf("pve1"), map[string]string{"provider": "pve-home", "country": "de"}; !maps.Equal(got, want) {
		t.Errorf("labels of pve1 = %v, want %v", got, want)
	}
	if got, want := c.LabelsOf("pve2"), map[string]string{"provider": "pve-home", "country": "fr", "rack": "r2"}; !maps.Equal(got, want) {
		t.Errorf("labels of pve2 = %v, want %v (the node's over the common ones)", got, want)
	}
	c, err = config.Parse([]byte(good + "taskPollInterval: 250ms\nrequestTimeout: 2m\n"))
	if err != nil {
		t.Fatal(err)
	}
	if time.Duration(c.TaskPollInterval) != 250*time.Millisecond || time.Duration(c.RequestTimeout) != 2*time.Minute {
		t.Errorf("taskPollInterval, requestTimeout = %v, %v; want 250ms, 2m",
			time.Duration(c.TaskPollInterval), time.Duration(c.RequestTimeout))
	}
}

func TestParseReportsEveryProblemByKey(t *testing.T) {
	for _, tc := range []struct {
		name, doc string
		want      []string
	}{
		{"empty", "{}", []string{"entry: is required", "apiURL: is required", "tokenFile: is required", "nodes: list at least one node", "templates: map at least one", "seedsStorage: is required"}},
		{"bad values", strings.NewReplacer(
			"vlanTag: 4", "vlanTag: 5000",
			"[pve1, pve2]", "[pve1, PVE_2, pve1]",
			"debian-13: 9000", "debian-13: 42",
			"cores: 1", "cores: 0",
			"https://192.168.0.8:8006", "http://192.168.0.8:8006",
		).Replace(good), []string{
			"vlanTag: must be 1-4094", "nodes[1]: must be 1-63 lowercase", `nodes[2]: node "pve1" is listed twice`,
			"templates.debian-13: VMID must be between 100", "profiles.small.cores: must be 1 or more", "apiURL: must be an https URL with a host",
		}},
		{"clone mode", good + "clone: fast\n", []string{`clone: must be "linked" or "full", got "fast"`}},
		{"clone storage on linked", good + "cloneStorage: local-lvm\n", []string{"cloneStorage: applies to full clones only"}},
		{"unknown key", good + "vlan: 4\n", []string{"vlan: unknown key"}},
		{"duration", good + "taskPollInterval: 1\nrequestTimeout: -5s\n", []string{
			`taskPollInterval: must be a duration such as "30s" or "10m", got "1"`, "requestTimeout: must be a positive duration"}},
		{"labels", good + "labels: {country: DE}\nnodeLabels: {pve3: {a: b}, pve2: {Rack: r2}}\n", []string{
			`labels.country: must be 1-63 lowercase letters, digits, '-' or '_', got "DE"`,
			"nodeLabels.pve3: names no listed target; the targets are pve1, pve2",
			`nodeLabels.pve2: every key must be 1-63 lowercase letters, digits, '-' or '_', got "Rack"`}},
		{"fingerprint", strings.Replace(good, "AA:BB", "ZZ:BB", 1), []string{"fingerprint: must be the SHA-256"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := config.Parse([]byte(tc.doc))
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
		})
	}
}
