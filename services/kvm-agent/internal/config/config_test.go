package config

import (
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agentconfig"
)

const valid = `
entry: kvm-home
target: host1
pool: default
network: default
images:
  debian-12:
    url: https://images.example/debian-12.qcow2
    sha256: ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789
profiles:
  small: {vcpus: 1, memoryMiB: 1024, diskGiB: 10}
`

func TestParseValidDefaults(t *testing.T) {
	c, err := Parse([]byte(valid))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	im := c.Images["debian-12"]
	checks := []struct{ name, got, want string }{
		{"socket", c.Libvirt.Socket, "/run/libvirt/libvirt-sock"},
		{"uri", c.Libvirt.URI, "qemu:///system"},
		{"domainType", c.DomainType, "kvm"},
		{"format", im.Format, "qcow2"},
		{"firmware", im.Firmware, "uefi"},
		{"sha256 lowered", im.SHA256[:6], "abcdef"},
		{"defaultImage", c.DefaultImage, "debian-12"},
		{"defaultProfile", c.DefaultProfile, "small"},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %q, want %q", ch.name, ch.got, ch.want)
		}
	}
	if c.Labels != nil {
		t.Errorf("labels = %v, want none", c.Labels)
	}
	c, err = Parse([]byte(valid + "labels: {region: eu-west, country: de, provider: home}\n"))
	if err != nil {
		t.Fatalf("Parse with labels: %v", err)
	}
	if want := map[string]string{"region": "eu-west", "country": "de", "provider": "home"}; !maps.Equal(c.Labels, want) {
		t.Errorf("labels = %v, want %v", c.Labels, want)
	}
	if !c.GuestAgent() {
		t.Error("installGuestAgent should default to true")
	}
	if time.Duration(c.Libvirt.RPCTimeout) != 30*time.Second {
		t.Errorf("rpcTimeout = %v", time.Duration(c.Libvirt.RPCTimeout))
	}
}

func TestParseProblems(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		want []string // each must appear as a problem prefix
	}{
		{"everything missing", `{}`, []string{"entry: is required", "target: is required", "pool: is required", "network: set network", "images: at least one", "profiles: at least one"}},
		{"bad values", `
entry: Kvm_Home
target: host1
pool: default
network: default
bridge: br0
vlan: 5000
domainType: xen
serialLogDir: logs/serial
images:
  Debian:
    url: ftp://x/y
    sha256: nothex
    format: vmdk
    firmware: coreboot
profiles:
  small: {vcpus: 0, memoryMiB: 16, diskGiB: 0}
`, []string{"entry: must be", "bridge: set either network or bridge", "vlan: must be between", "domainType: must be kvm or qemu", "serialLogDir: must be an absolute path", "images.Debian: must be 1-63 lowercase",
			"images.Debian.url: must be an http", "images.Debian.sha256: must be 64", "images.Debian.format: must be qcow2 or raw", "images.Debian.firmware: must be uefi or bios",
			"profiles.small.vcpus:", "profiles.small.memoryMiB:", "profiles.small.diskGiB:"}},
		{"ssh without known_hosts", `
entry: e
target: t
libvirt:
  ssh: {host: h, user: u, keyFile: /k}
pool: default
network: default
images: {a: {url: "http://h/a"}}
profiles: {p: {vcpus: 1, memoryMiB: 512, diskGiB: 1}}
`, []string{"libvirt.ssh.knownHostsFile: is required"}},
		{"unknown default image", `
entry: e
target: t
pool: default
network: default
defaultImage: nope
images: {a: {url: "http://h/a"}, b: {url: "http://h/b"}}
profiles: {p: {vcpus: 1, memoryMiB: 512, diskGiB: 1}}
`, []string{"defaultImage: names no key"}},
		{"bad labels", `
entry: e
target: t
pool: default
network: default
labels: {region: EU, Country: de}
images: {a: {url: "http://h/a"}}
profiles: {p: {vcpus: 1, memoryMiB: 512, diskGiB: 1}}
`, []string{`labels: every key must be 1-63 lowercase letters, digits, '-' or '_', got "Country"`, `labels.region: must be 1-63 lowercase letters, digits, '-' or '_', got "EU"`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.doc))
			ce, ok := errors.AsType[*agentconfig.Error](err)
			if !ok {
				t.Fatalf("Parse error = %v, want *agentconfig.Error", err)
			}
			if len(ce.Problems) != len(tc.want) {
				t.Errorf("got %d problems, want %d:\n%s", len(ce.Problems), len(tc.want), err)
			}
			for _, w := range tc.want {
				found := false
				for _, p := range ce.Problems {
					if strings.HasPrefix(p.String(), w) {
						found = true
					}
				}
				if !found {
					t.Errorf("missing problem %q in:\n%s", w, err)
				}
			}
		})
	}
}

func TestParseUnknownKey(t *testing.T) {
	_, err := Parse([]byte(valid + "imgaes: {}\n"))
	if err == nil || !strings.Contains(err.Error(), "imgaes") {
		t.Fatalf("Parse with a misspelt key: err = %v, want one naming imgaes", err)
	}
	_, err = Parse([]byte(strings.Replace(valid, "    sha256:", "    sha265:", 1)))
	if want := "\n  images.debian-12.sha265: unknown key"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Parse with a misspelt nested key: err = %v, want one containing %q", err, want)
	}
}

func TestParseBadDurationNamesItsKey(t *testing.T) {
	_, err := Parse([]byte(valid + "libvirt: {rpcTimeout: soon}\n"))
	if want := `libvirt.rpcTimeout: must be a duration such as "30s" or "10m", got "soon"`; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Parse with a bad duration: err = %v, want one containing %q", err, want)
	}
}
