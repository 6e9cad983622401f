// Package config reads and validates the kvm-agent's configuration file.
// Validation reports every problem at once, one message per problem, each
// naming the key it is about.
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

	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/events"
)

// Config is the kvm-agent configuration: one entry, one target (host).
type Config struct {
	Entry  string `yaml:"entry"`
	Target string `yaml:"target"`

	Libvirt Libvirt `yaml:"libvirt"`

	// Pool is the libvirt storage pool holding base images, overlays and
	// seeds.
	Pool string `yaml:"pool"`
	// Network (a libvirt network) or Bridge (a host bridge): exactly one.
	Network string `yaml:"network"`
	Bridge  string `yaml:"bridge"`
	// VLAN tags the guest interface when set (1-4094).
	VLAN int `yaml:"vlan"`
	// DomainType is kvm (default) or qemu (TCG, no hardware acceleration).
	DomainType string `yaml:"domainType"`

	Images   map[string]Image   `yaml:"images"`
	Profiles map[string]Profile `yaml:"profiles"`
	// DefaultImage and DefaultProfile apply when a pool names none; with a
	// single image or profile configured, that one is the default.
	DefaultImage   string `yaml:"defaultImage"`
	DefaultProfile string `yaml:"defaultProfile"`

	// InstallGuestAgent adds the vendor-data script that installs
	// qemu-guest-agent (default true).
	InstallGuestAgent *bool `yaml:"installGuestAgent"`
	// VendorData is extra vendor-data sent beside the guest-agent script.
	VendorData string `yaml:"vendorData"`
	// Capacity is the most proxies this host holds; 0 means unlimited.
	Capacity int `yaml:"capacity"`
}

// Libvirt says how to reach libvirtd: the local socket, or SSH.
type Libvirt struct {
	// Socket is the local unix socket (default /run/libvirt/libvirt-sock).
	Socket string `yaml:"socket"`
	SSH    *SSH   `yaml:"ssh"`
	// URI is the libvirt URI (default qemu:///system).
	URI string `yaml:"uri"`
	// RPCTimeout bounds one libvirt call (default 30s).
	RPCTimeout Duration `yaml:"rpcTimeout"`
	// TransferTimeout bounds one image download and upload (default 20m).
	TransferTimeout Duration `yaml:"transferTimeout"`
}

// SSH is a remote libvirtd reached through an SSH session.
type SSH struct {
	Host           string `yaml:"host"` // host or host:port (default port 22)
	User           string `yaml:"user"`
	KeyFile        string `yaml:"keyFile"`
	KnownHostsFile string `yaml:"knownHostsFile"`
	// Socket is the remote libvirtd socket (default /run/libvirt/libvirt-sock).
	Socket string `yaml:"socket"`
}

// Image is one cached base image.
type Image struct {
	URL    string `yaml:"url"`
	SHA256 string `yaml:"sha256"`
	// Format is the disk format of the image: qcow2 (default) or raw.
	Format string `yaml:"format"`
	// Firmware is uefi (default) or bios.
	Firmware string `yaml:"firmware"`
}

// Profile is a machine size.
type Profile struct {
	VCPUs     int `yaml:"vcpus"`
	MemoryMiB int `yaml:"memoryMiB"`
	DiskGiB   int `yaml:"diskGiB"`
}

// Duration is a time.Duration written as "30s".
type Duration time.Duration

// UnmarshalYAML reads a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("must be a duration such as \"30s\": %q", n.Value)
	}
	*d = Duration(v)
	return nil
}

// GuestAgent reports whether the guest-agent script is installed.
func (c *Config) GuestAgent() bool { return c.InstallGuestAgent == nil || *c.InstallGuestAgent }

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(b)
}

// Parse decodes a configuration document (YAML; unknown keys are errors),
// applies defaults and validates it.
func Parse(b []byte) (*Config, error) {
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	c.defaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

func (c *Config) defaults() {
	if c.Libvirt.SSH == nil && c.Libvirt.Socket == "" {
		c.Libvirt.Socket = "/run/libvirt/libvirt-sock"
	}
	if c.Libvirt.SSH != nil && c.Libvirt.SSH.Socket == "" {
		c.Libvirt.SSH.Socket = "/run/libvirt/libvirt-sock"
	}
	if c.Libvirt.URI == "" {
		c.Libvirt.URI = "qemu:///system"
	}
	if c.Libvirt.RPCTimeout == 0 {
		c.Libvirt.RPCTimeout = Duration(30 * time.Second)
	}
	if c.Libvirt.TransferTimeout == 0 {
		c.Libvirt.TransferTimeout = Duration(20 * time.Minute)
	}
	if c.DomainType == "" {
		c.DomainType = "kvm"
	}
	for k, im := range c.Images {
		if im.Format == "" {
			im.Format = "qcow2"
		}
		if im.Firmware == "" {
			im.Firmware = "uefi"
		}
		im.SHA256 = strings.ToLower(im.SHA256)
		c.Images[k] = im
	}
	if c.DefaultImage == "" && len(c.Images) == 1 {
		for k := range c.Images {
			c.DefaultImage = k
		}
	}
	if c.DefaultProfile == "" && len(c.Profiles) == 1 {
		for k := range c.Profiles {
			c.DefaultProfile = k
		}
	}
}

// Error lists every problem of a configuration.
type Error struct{ Problems []string }

func (e *Error) Error() string {
	return "invalid kvm-agent config:\n  " + strings.Join(e.Problems, "\n  ")
}

var (
	sha256RE = regexp.MustCompile(`^[0-9a-f]{64}$`)
	nameRE   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
)

// Validate checks every field.
func (c *Config) Validate() error {
	var p []string
	add := func(key, format string, args ...any) { p = append(p, key+": "+fmt.Sprintf(format, args...)) }
	ident := func(key, v string) {
		if fe := events.CheckIdentifier(key, v); fe != nil {
			add(key, "%s", fe.Reason)
		}
	}
	ident("entry", c.Entry)
	ident("target", c.Target)

	lv := c.Libvirt
	if lv.SSH != nil {
		if lv.Socket != "" {
			add("libvirt.socket", "set either libvirt.socket or libvirt.ssh, not both")
		}
		s := lv.SSH
		if s.Host == "" {
			add("libvirt.ssh.host", "is required")
		}
		if s.User == "" {
			add("libvirt.ssh.user", "is required")
		}
		if s.KeyFile == "" {
			add("libvirt.ssh.keyFile", "is required")
		}
		if s.KnownHostsFile == "" {
			add("libvirt.ssh.knownHostsFile", "is required: the host key is always verified")
		}
		if !strings.HasPrefix(s.Socket, "/") {
			add("libvirt.ssh.socket", "must be an absolute path, got %q", s.Socket)
		}
	} else if !strings.HasPrefix(lv.Socket, "/") {
		add("libvirt.socket", "must be an absolute path, got %q", lv.Socket)
	}
	if _, err := url.Parse(lv.URI); err != nil || !strings.Contains(lv.URI, "://") {
		add("libvirt.uri", "must be a libvirt URI such as qemu:///system, got %q", lv.URI)
	}
	if lv.RPCTimeout < Duration(time.Second) {
		add("libvirt.rpcTimeout", "must be at least 1s")
	}
	if lv.TransferTimeout < Duration(2*time.Minute) {
		add("libvirt.transferTimeout", "must be at least 2m (the download gets a deadline one minute inside it)")
	}

	if c.Pool == "" {
		add("pool", "is required (a libvirt storage pool name)")
	} else if !nameRE.MatchString(c.Pool) {
		add("pool", "is not a valid libvirt pool name: %q", c.Pool)
	}
	switch {
	case c.Network == "" && c.Bridge == "":
		add("network", "set network (a libvirt network) or bridge (a host bridge)")
	case c.Network != "" && c.Bridge != "":
		add("bridge", "set either network or bridge, not both")
	case c.Network != "" && !nameRE.MatchString(c.Network):
		add("network", "is not a valid libvirt network name: %q", c.Network)
	case c.Bridge != "" && !nameRE.MatchString(c.Bridge):
		add("bridge", "is not a valid interface name: %q", c.Bridge)
	}
	if c.VLAN < 0 || c.VLAN > 4094 {
		add("vlan", "must be between 1 and 4094 (0 or absent: untagged), got %d", c.VLAN)
	}
	if c.DomainType != "kvm" && c.DomainType != "qemu" {
		add("domainType", "must be kvm or qemu, got %q", c.DomainType)
	}

	if len(c.Images) == 0 {
		add("images", "at least one image is required")
	}
	for _, k := range sortedKeys(c.Images) {
		im := c.Images[k]
		key := "images." + k
		if !events.IsIdentifier(k) {
			add(key, "image key must be %s", events.IdentifierRule)
		}
		u, err := url.Parse(im.URL)
		switch {
		case im.URL == "":
			add(key+".url", "is required")
		case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
			add(key+".url", "must be an http or https URL, got %q", im.URL)
		}
		if im.SHA256 != "" && !sha256RE.MatchString(im.SHA256) {
			add(key+".sha256", "must be 64 hexadecimal characters")
		}
		if im.Format != "qcow2" && im.Format != "raw" {
			add(key+".format", "must be qcow2 or raw, got %q", im.Format)
		}
		if im.Firmware != "uefi" && im.Firmware != "bios" {
			add(key+".firmware", "must be uefi or bios, got %q", im.Firmware)
		}
	}
	if c.DefaultImage != "" {
		if _, ok := c.Images[c.DefaultImage]; !ok {
			add("defaultImage", "names no key of images: %q", c.DefaultImage)
		}
	}

	if len(c.Profiles) == 0 {
		add("profiles", "at least one machine profile is required")
	}
	for _, k := range sortedKeys(c.Profiles) {
		pr := c.Profiles[k]
		key := "profiles." + k
		if !events.IsIdentifier(k) {
			add(key, "profile name must be %s", events.IdentifierRule)
		}
		if pr.VCPUs < 1 || pr.VCPUs > 256 {
			add(key+".vcpus", "must be between 1 and 256, got %d", pr.VCPUs)
		}
		if pr.MemoryMiB < 128 {
			add(key+".memoryMiB", "must be at least 128, got %d", pr.MemoryMiB)
		}
		if pr.DiskGiB < 1 {
			add(key+".diskGiB", "must be at least 1, got %d", pr.DiskGiB)
		}
	}
	if c.DefaultProfile != "" {
		if _, ok := c.Profiles[c.DefaultProfile]; !ok {
			add("defaultProfile", "names no key of profiles: %q", c.DefaultProfile)
		}
	}
	if c.Capacity < 0 {
		add("capacity", "must be zero (unlimited) or more, got %d", c.Capacity)
	}
	if len(c.VendorData) > 64<<10 {
		add("vendorData", "must be at most 64 KiB")
	}
	if len(p) > 0 {
		return &Error{Problems: p}
	}
	return nil
}

// AsError returns the [*Error] in err, if any.
func AsError(err error) (*Error, bool) {
	var e *Error
	ok := errors.As(err, &e)
	return e, ok
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
