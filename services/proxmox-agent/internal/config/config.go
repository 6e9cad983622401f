// Package config loads and validates the proxmox-agent configuration file:
// how to reach one Proxmox VE cluster, which of its nodes the agent may use
// (each node is a target), and how to build a proxy VM there.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"proxyfleet/pkg/events"
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
	// MinFreeMiB is the free space below which a storage check fails
	// (default 1024).
	MinFreeMiB int64 `yaml:"minFreeMiB"`
	// InstallGuestAgent adds the guest-agent installer to the seed's
	// vendor-data (default true).
	InstallGuestAgent *bool `yaml:"installGuestAgent"`
	// TaskPollInterval is how often a task is polled (default 1s).
	TaskPollInterval string `yaml:"taskPollInterval"`
	// RequestTimeout bounds one API request (default 60s).
	RequestTimeout string `yaml:"requestTimeout"`
}

// Profile is the size of one machine profile.
type Profile struct {
	Cores     int `yaml:"cores"`
	MemoryMiB int `yaml:"memoryMiB"`
}

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	c, err := Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// Parse decodes and validates a configuration document. Unknown keys are
// errors.
func Parse(raw []byte) (*Config, error) {
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("%s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	c.defaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

func (c *Config) defaults() {
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
}

var (
	storageRE = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9\-_.]*[a-zA-Z0-9]$`)
	bridgeRE  = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9_.\-]{0,14}$`)
)

// Validate returns every problem, one line each, naming its key.
func (c *Config) Validate() error {
	var errs []string
	add := func(key, format string, args ...any) {
		errs = append(errs, key+": "+fmt.Sprintf(format, args...))
	}
	ident := func(key, v string) {
		if fe := events.CheckIdentifier(key, v); fe != nil {
			add(key, "%s", fe.Reason+quoted(fe.Value))
		}
	}
	ident("entry", c.Entry)
	ident("cluster", c.Cluster)
	if u, err := url.Parse(c.APIURL); c.APIURL == "" {
		add("apiURL", "is required (https://<node address>:8006)")
	} else if err != nil || u.Scheme != "https" || u.Host == "" {
		add("apiURL", "must be https://<host>:<port>, got %q", c.APIURL)
	}
	if c.TokenFile == "" {
		add("tokenFile", "is required (a file holding user@realm!tokenid=secret)")
	}
	if c.CAFile != "" && c.Fingerprint != "" {
		add("fingerprint", "set caFile or fingerprint, not both")
	}
	if c.Fingerprint != "" {
		hexs := strings.ReplaceAll(c.Fingerprint, ":", "")
		if len(hexs) != 64 || strings.Trim(strings.ToLower(hexs), "0123456789abcdef") != "" {
			add("fingerprint", "must be the SHA-256 of the node certificate as 64 hex digits (colons optional)")
		}
	}
	if len(c.Nodes) == 0 {
		add("nodes", "list at least one node")
	}
	seen := map[string]bool{}
	for i, n := range c.Nodes {
		key := fmt.Sprintf("nodes[%d]", i)
		ident(key, n)
		if seen[n] {
			add(key, "node %q is listed twice", n)
		}
		seen[n] = true
	}
	if len(c.Templates) == 0 {
		add("templates", "map at least one image key to a template VMID")
	}
	for _, k := range sortedKeys(c.Templates) {
		key := "templates." + k
		ident(key, k)
		if id := c.Templates[k]; id < 100 || id > 999999999 {
			add(key, "VMID must be between 100 and 999999999, got %d", id)
		}
	}
	if c.SeedsStorage == "" {
		add("seedsStorage", "is required: a dedicated storage with content type iso that the token may delete from")
	} else if !storageRE.MatchString(c.SeedsStorage) {
		add("seedsStorage", "%q is not a storage ID", c.SeedsStorage)
	}
	if c.CloneStorage != "" && !storageRE.MatchString(c.CloneStorage) {
		add("cloneStorage", "%q is not a storage ID", c.CloneStorage)
	}
	if !bridgeRE.MatchString(c.Bridge) {
		add("bridge", "%q is not a bridge name", c.Bridge)
	}
	if c.VLANTag < 0 || c.VLANTag > 4094 {
		add("vlanTag", "must be 1-4094, or 0 for untagged; got %d", c.VLANTag)
	}
	if c.Clone != CloneLinked && c.Clone != CloneFull {
		add("clone", "must be %q or %q, got %q", CloneLinked, CloneFull, c.Clone)
	}
	if c.CloneStorage != "" && c.Clone != CloneFull {
		add("cloneStorage", "applies to full clones only; set clone: full or remove it")
	}
	for _, k := range sortedKeys(c.Profiles) {
		key := "profiles." + k
		ident(key, k)
		p := c.Profiles[k]
		if p.Cores < 1 {
			add(key+".cores", "must be 1 or more, got %d", p.Cores)
		}
		if p.MemoryMiB < 16 {
			add(key+".memoryMiB", "must be 16 or more, got %d", p.MemoryMiB)
		}
	}
	if c.Capacity < 0 {
		add("capacity", "must be 0 (unlimited) or more, got %d", c.Capacity)
	}
	if c.MinFreeMiB < 0 {
		add("minFreeMiB", "must not be negative")
	}
	for key, v := range map[string]string{"taskPollInterval": c.TaskPollInterval, "requestTimeout": c.RequestTimeout} {
		if v == "" {
			continue
		}
		if d, err := time.ParseDuration(v); err != nil || d <= 0 {
			add(key, "must be a positive duration such as \"1s\", got %q", v)
		}
	}
	if len(errs) == 0 {
		return nil
	}
	sort.Strings(errs)
	return errors.New(strings.Join(errs, "\n"))
}

// GuestAgent reports whether seeds install the guest agent.
func (c *Config) GuestAgent() bool { return c.InstallGuestAgent == nil || *c.InstallGuestAgent }

// TaskPoll returns the task poll interval.
func (c *Config) TaskPoll() time.Duration { return duration(c.TaskPollInterval, time.Second) }

// Timeout returns the per-request timeout.
func (c *Config) Timeout() time.Duration { return duration(c.RequestTimeout, 60*time.Second) }

// ImageKeys returns the configured image keys, sorted.
func (c *Config) ImageKeys() []string { return sortedKeys(c.Templates) }

// ProfileNames returns the configured machine profiles, sorted.
func (c *Config) ProfileNames() []string { return sortedKeys(c.Profiles) }

func duration(s string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return d
	}
	return def
}

func quoted(v string) string {
	if v == "" {
		return ""
	}
	return fmt.Sprintf(", got %q", v)
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
