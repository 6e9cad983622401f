// Package config loads and validates the proxmox-agent configuration file:
// how to reach one Proxmox VE cluster, which of its nodes the agent may use
// (each node is a target), and how to build a proxy VM there.
package config

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/events"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// Clone modes.
const (
	CloneLinked = "linked"
	CloneFull   = "full"
)

// Config is the agent's configuration. See docs/proxmox.md for every key.
type Config struct {
	// Entry is the provider entry name the agent announces.
	Entry string `yaml:"entry"`
	// Cluster names the VMID reservation namespace in the fleet-vmids
	// bucket (default: Entry). Agents of one Proxmox VE cluster must share it.
	Cluster string `yaml:"cluster"`
	// APIURL is https://host:8006, the address the node certificate names.
	APIURL string `yaml:"apiURL"`
	// TokenFile holds "user@realm!tokenid=secret".
	TokenFile string `yaml:"tokenFile"`
	// CAFile or Fingerprint verify the API's certificate.
	CAFile      string `yaml:"caFile"`
	Fingerprint string `yaml:"fingerprint"`
	// Nodes the agent may place proxies on; each is a target.
	Nodes []string `yaml:"nodes"`
	// Templates maps an image key to the VMID of a template VM.
	Templates map[string]int `yaml:"templates"`
	// SeedsStorage is the dedicated storage (content iso) for seed ISOs.
	SeedsStorage string `yaml:"seedsStorage"`
	// CloneStorage is the target storage of full clones (optional).
	CloneStorage string `yaml:"cloneStorage"`
	// Bridge and VLANTag configure net0 (VLANTag 0: untagged).
	Bridge  string `yaml:"bridge"`
	VLANTag int    `yaml:"vlanTag"`
	// Clone is "linked" (default) or "full".
	Clone string `yaml:"clone"`
	// Profiles maps a machine profile name to its size.
	Profiles map[string]Profile `yaml:"profiles"`
	// Capacity is how many proxies each node may hold (0: unlimited).
	Capacity int `yaml:"capacity"`
	// Labels are announced by every node ({provider: pve-home, country:
	// de}); NodeLabels adds to or overrides them per node. See
	// [Config.LabelsOf].
	Labels     map[string]string            `yaml:"labels"`
	NodeLabels map[string]map[string]string `yaml:"nodeLabels"`
	// MinFreeMiB is the free space below which a storage check fails
	// (default 1024).
	MinFreeMiB int64 `yaml:"minFreeMiB"`
	// InstallGuestAgent adds the guest-agent installer to the seed's
	// vendor-data (default true).
	InstallGuestAgent *bool `yaml:"installGuestAgent"`
	// TaskPollInterval is how often a task is polled (default 1s).
	TaskPollInterval agentconfig.Duration `yaml:"taskPollInterval"`
	// RequestTimeout bounds one API request (default 60s).
	RequestTimeout agentconfig.Duration `yaml:"requestTimeout"`
}

// LabelsOf is what node announces as its labels: the common labels with
// the node's own over them; nil when it has none.
func (c *Config) LabelsOf(node string) map[string]string {
	return events.MergeLabels(c.Labels, c.NodeLabels[node])
}

// Profile is the size of one machine profile.
type Profile struct {
	Cores     int `yaml:"cores"`
	MemoryMiB int `yaml:"memoryMiB"`
}

// Load reads and validates the file at path; its problems come back as one
// [*agentconfig.Error].
func Load(path string) (*Config, error) { return agentconfig.Load[Config](path) }

// Parse decodes and validates a configuration document. Unknown keys are
// errors.
func Parse(raw []byte) (*Config, error) { return agentconfig.Parse[Config](raw) }

// Defaults fills what the document leaves out.
func (c *Config) Defaults() {
	if c.Cluster == "" {
		c.Cluster = c.Entry
	}
	if c.Clone == "" {
		c.Clone = CloneLinked
	}
	if c.MinFreeMiB == 0 {
		c.MinFreeMiB = 1024
	}
	if c.Bridge == "" {
		c.Bridge = "vmbr0"
	}
	if c.TaskPollInterval == 0 {
		c.TaskPollInterval = agentconfig.Duration(time.Second)
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = agentconfig.Duration(60 * time.Second)
	}
}

var (
	storageRE = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9\-_.]*[a-zA-Z0-9]$`)
	bridgeRE  = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9_.\-]{0,14}$`)
)

// Check adds every problem of the configuration to e.
func (c *Config) Check(e *agentconfig.Error) {
	e.Entry("entry", c.Entry)
	e.Identifier("cluster", c.Cluster)
	if c.APIURL == "" {
		e.Add("apiURL", "is required (https://<node address>:8006)")
	}
	e.URL("apiURL", c.APIURL, "https")
	if c.TokenFile == "" {
		e.Add("tokenFile", "is required (a file holding user@realm!tokenid=secret)")
	}
	if c.CAFile != "" && c.Fingerprint != "" {
		e.Add("fingerprint", "set caFile or fingerprint, not both")
	}
	if c.Fingerprint != "" {
		hexs := strings.ReplaceAll(c.Fingerprint, ":", "")
		if len(hexs) != 64 || strings.Trim(strings.ToLower(hexs), "0123456789abcdef") != "" {
			e.Add("fingerprint", "must be the SHA-256 of the node certificate as 64 hex digits (colons optional)")
		}
	}
	if len(c.Nodes) == 0 {
		e.Add("nodes", "list at least one node")
	}
	seen := map[string]bool{}
	for i, n := range c.Nodes {
		key := fmt.Sprintf("nodes[%d]", i)
		e.Identifier(key, n)
		if seen[n] {
			e.Add(key, "node %q is listed twice", n)
		}
		seen[n] = true
	}
	if len(c.Templates) == 0 {
		e.Add("templates", "map at least one image key to a template VMID")
	}
	agentconfig.Keyed(e, "templates", c.Templates, func(key string, id int) {
		if id < 100 || id > 999999999 {
			e.Add(key, "VMID must be between 100 and 999999999, got %d", id)
		}
	})
	if c.SeedsStorage == "" {
		e.Add("seedsStorage", "is required: a dedicated storage with content type iso that the token may delete from")
	} else if !storageRE.MatchString(c.SeedsStorage) {
		e.Add("seedsStorage", "%q is not a storage ID", c.SeedsStorage)
	}
	if c.CloneStorage != "" && !storageRE.MatchString(c.CloneStorage) {
		e.Add("cloneStorage", "%q is not a storage ID", c.CloneStorage)
	}
	if !bridgeRE.MatchString(c.Bridge) {
		e.Add("bridge", "%q is not a bridge name", c.Bridge)
	}
	if c.VLANTag < 0 || c.VLANTag > 4094 {
		e.Add("vlanTag", "must be 1-4094, or 0 for untagged; got %d", c.VLANTag)
	}
	if c.Clone != CloneLinked && c.Clone != CloneFull {
		e.Add("clone", "must be %q or %q, got %q", CloneLinked, CloneFull, c.Clone)
	}
	if c.CloneStorage != "" && c.Clone != CloneFull {
		e.Add("cloneStorage", "applies to full clones only; set clone: full or remove it")
	}
	agentconfig.Keyed(e, "profiles", c.Profiles, func(key string, p Profile) {
		if p.Cores < 1 {
			e.Add(key+".cores", "must be 1 or more, got %d", p.Cores)
		}
		if p.MemoryMiB < 16 {
			e.Add(key+".memoryMiB", "must be 16 or more, got %d", p.MemoryMiB)
		}
	})
	e.Labels("labels", c.Labels)
	e.TargetLabels("nodeLabels", c.NodeLabels, c.Nodes)
	for _, n := range c.Nodes {
		if k := len(c.LabelsOf(n)); k > events.MaxLabels {
			e.Add("nodeLabels."+n, "node %s would carry %d labels with the common ones; at most %d are allowed", n, k, events.MaxLabels)
		}
	}
	if c.Capacity < 0 {
		e.Add("capacity", "must be 0 (unlimited) or more, got %d", c.Capacity)
	}
	if c.MinFreeMiB < 0 {
		e.Add("minFreeMiB", "must not be negative")
	}
	if c.TaskPollInterval < 0 {
		e.Add("taskPollInterval", "must be a positive duration such as \"1s\", got %s", time.Duration(c.TaskPollInterval))
	}
	if c.RequestTimeout < 0 {
		e.Add("requestTimeout", "must be a positive duration such as \"60s\", got %s", time.Duration(c.RequestTimeout))
	}
}

// GuestAgent reports whether seeds install the guest agent.
func (c *Config) GuestAgent() bool { return c.InstallGuestAgent == nil || *c.InstallGuestAgent }

// ClientConfig is the configuration of the API client this file
// describes; the caller adds its logger and tracer.
func (c *Config) ClientConfig() pve.Config {
	return pve.Config{URL: c.APIURL, TokenFile: c.TokenFile, CAFile: c.CAFile, Fingerprint: c.Fingerprint,
		TaskPollInterval: time.Duration(c.TaskPollInterval), RequestTimeout: time.Duration(c.RequestTimeout)}
}

// ImageKeys returns the configured image keys, sorted.
func (c *Config) ImageKeys() []string { return slices.Sorted(maps.Keys(c.Templates)) }

// ProfileNames returns the configured machine profiles, sorted.
func (c *Config) ProfileNames() []string { return slices.Sorted(maps.Keys(c.Profiles)) }
