// Package config reads and validates the kvm-agent's configuration file
// through [agentconfig]: every problem is reported at once, each naming the
// key it is about.
package config

import (
	"regexp"
	"strings"
	"time"

	"proxyfleet/pkg/agentconfig"
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
	// Labels are the target's labels ({region: eu-west, country: de,
	// provider: home}), announced to the planner, which records them on
	// every proxy it places here.
	Labels map[string]string `yaml:"labels"`
	// SerialLogDir, when set, makes libvirt (virtlogd) log each domain's
	// serial console to <serialLogDir>/<instance>.log on the libvirt host,
	// truncated at every start. An absolute path.
	SerialLogDir string `yaml:"serialLogDir"`
}

// Libvirt says how to reach libvirtd: the local socket, or SSH.
type Libvirt struct {
	// Socket is the local unix socket (default /run/libvirt/libvirt-sock).
	Socket string `yaml:"socket"`
	SSH    *SSH   `yaml:"ssh"`
	// URI is the libvirt URI (default qemu:///system).
	URI string `yaml:"uri"`
	// RPCTimeout bounds one libvirt call (default 30s).
	RPCTimeout agentconfig.Duration `yaml:"rpcTimeout"`
	// TransferTimeout bounds one image download and upload (default 20m).
	TransferTimeout agentconfig.Duration `yaml:"transferTimeout"`
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

// GuestAgent reports whether the guest-agent script is installed.
func (c *Config) GuestAgent() bool { return c.InstallGuestAgent == nil || *c.InstallGuestAgent }

// Load reads and validates the file at path; its problems come back as one
// [*agentconfig.Error].
func Load(path string) (*Config, error) { return agentconfig.Load[Config](path) }

// Parse decodes a configuration document (YAML; unknown keys are errors),
// applies defaults and validates it.
func Parse(b []byte) (*Config, error) { return agentconfig.Parse[Config](b) }

// Defaults fills what the document leaves out.
func (c *Config) Defaults() {
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
		c.Libvirt.RPCTimeout = agentconfig.Duration(30 * time.Second)
	}
	if c.Libvirt.TransferTimeout == 0 {
		c.Libvirt.TransferTimeout = agentconfig.Duration(20 * time.Minute)
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

var (
	sha256RE = regexp.MustCompile(`^[0-9a-f]{64}$`)
	nameRE   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
)

// Check adds every problem of the configuration to e.
func (c *Config) Check(e *agentconfig.Error) {
	e.Entry("entry", c.Entry)
	e.Identifier("target", c.Target)
	e.Labels("labels", c.Labels)

	lv := c.Libvirt
	if lv.SSH != nil {
		if lv.Socket != "" {
			e.Add("libvirt.socket", "set either libvirt.socket or libvirt.ssh, not both")
		}
		s := lv.SSH
		if s.Host == "" {
			e.Add("libvirt.ssh.host", "is required")
		}
		if s.User == "" {
			e.Add("libvirt.ssh.user", "is required")
		}
		if s.KeyFile == "" {
			e.Add("libvirt.ssh.keyFile", "is required")
		}
		if s.KnownHostsFile == "" {
			e.Add("libvirt.ssh.knownHostsFile", "is required: the host key is always verified")
		}
		if !strings.HasPrefix(s.Socket, "/") {
			e.Add("libvirt.ssh.socket", "must be an absolute path, got %q", s.Socket)
		}
	} else if !strings.HasPrefix(lv.Socket, "/") {
		e.Add("libvirt.socket", "must be an absolute path, got %q", lv.Socket)
	}
	if !strings.Contains(lv.URI, "://") {
		e.Add("libvirt.uri", "must be a libvirt URI such as qemu:///system, got %q", lv.URI)
	}
	if lv.RPCTimeout < agentconfig.Duration(time.Second) {
		e.Add("libvirt.rpcTimeout", "must be at least 1s")
	}
	if lv.TransferTimeout < agentconfig.Duration(2*time.Minute) {
		e.Add("libvirt.transferTimeout", "must be at least 2m (the download gets a deadline one minute inside it)")
	}

	if c.Pool == "" {
		e.Add("pool", "is required (a libvirt storage pool name)")
	} else if !nameRE.MatchString(c.Pool) {
		e.Add("pool", "is not a valid libvirt pool name: %q", c.Pool)
	}
	switch {
	case c.Network == "" && c.Bridge == "":
		e.Add("network", "set network (a libvirt network) or bridge (a host bridge)")
	case c.Network != "" && c.Bridge != "":
		e.Add("bridge", "set either network or bridge, not both")
	case c.Network != "" && !nameRE.MatchString(c.Network):
		e.Add("network", "is not a valid libvirt network name: %q", c.Network)
	case c.Bridge != "" && !nameRE.MatchString(c.Bridge):
		e.Add("bridge", "is not a valid interface name: %q", c.Bridge)
	}
	if c.VLAN < 0 || c.VLAN > 4094 {
		e.Add("vlan", "must be between 1 and 4094 (0 or absent: untagged), got %d", c.VLAN)
	}
	if c.SerialLogDir != "" && !strings.HasPrefix(c.SerialLogDir, "/") {
		e.Add("serialLogDir", "must be an absolute path on the libvirt host, got %q", c.SerialLogDir)
	}
	if c.DomainType != "kvm" && c.DomainType != "qemu" {
		e.Add("domainType", "must be kvm or qemu, got %q", c.DomainType)
	}

	if len(c.Images) == 0 {
		e.Add("images", "at least one image is required")
	}
	agentconfig.Keyed(e, "images", c.Images, func(key string, im Image) {
		if im.URL == "" {
			e.Add(key+".url", "is required")
		}
		e.URL(key+".url", im.URL, "http", "https")
		if im.SHA256 != "" && !sha256RE.MatchString(im.SHA256) {
			e.Add(key+".sha256", "must be 64 hexadecimal characters")
		}
		if im.Format != "qcow2" && im.Format != "raw" {
			e.Add(key+".format", "must be qcow2 or raw, got %q", im.Format)
		}
		if im.Firmware != "uefi" && im.Firmware != "bios" {
			e.Add(key+".firmware", "must be uefi or bios, got %q", im.Firmware)
		}
	})
	agentconfig.KeyOf(e, "defaultImage", c.DefaultImage, c.Images, "images")

	if len(c.Profiles) == 0 {
		e.Add("profiles", "at least one machine profile is required")
	}
	agentconfig.Keyed(e, "profiles", c.Profiles, func(key string, pr Profile) {
		if pr.VCPUs < 1 || pr.VCPUs > 256 {
			e.Add(key+".vcpus", "must be between 1 and 256, got %d", pr.VCPUs)
		}
		if pr.MemoryMiB < 128 {
			e.Add(key+".memoryMiB", "must be at least 128, got %d", pr.MemoryMiB)
		}
		if pr.DiskGiB < 1 {
			e.Add(key+".diskGiB", "must be at least 1, got %d", pr.DiskGiB)
		}
	})
	agentconfig.KeyOf(e, "defaultProfile", c.DefaultProfile, c.Profiles, "profiles")
	if c.Capacity < 0 {
		e.Add("capacity", "must be zero (unlimited) or more, got %d", c.Capacity)
	}
	if len(c.VendorData) > 64<<10 {
		e.Add("vendorData", "must be at most 64 KiB")
	}
}
