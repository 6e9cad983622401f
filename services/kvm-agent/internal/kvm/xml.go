package kvm

import (
	"bytes"
	"crypto/sha256"
	"encoding/xml"
	"fmt"
	"strings"

	"proxyfleet/pkg/agent"
)

// MetadataURI is the namespace of the marker element in domain metadata.
const MetadataURI = "https://proxyfleet.dev/xmlns/libvirt/instance/v1"

// metadataPrefix is the prefix the marker element is written with.
const metadataPrefix = "proxyfleet"

// marker is the metadata element that makes a domain ours.
type marker struct {
	XMLName xml.Name `xml:"instance"`
	ProxyID string   `xml:"proxy"`
	Pool    string   `xml:"pool"`
	Entry   string   `xml:"entry"`
	Image   string   `xml:"image,omitempty"`
	Port    int      `xml:"port,omitempty"`
}

// agentMarker is the garbage-collection marker the runtime knows.
func (m marker) agentMarker() agent.Marker {
	return agent.Marker{ProxyID: m.ProxyID, Pool: m.Pool, Entry: m.Entry}
}

// parseMarker reads the marker element. libvirt returns it without the
// namespace declaration it was defined with (the lookup by namespace has
// already selected it), so elements match by local name only.
func parseMarker(s string) (marker, error) {
	var m marker
	if err := xml.Unmarshal([]byte(s), &m); err != nil {
		return marker{}, fmt.Errorf("parse domain metadata: %w", err)
	}
	if m.ProxyID == "" || m.Entry == "" {
		return marker{}, fmt.Errorf("domain metadata lacks proxy or entry")
	}
	return m, nil
}

// domainParams is everything the domain XML depends on.
type domainParams struct {
	Name       string
	Type       string // kvm or qemu
	Marker     agent.Marker
	Image      string
	Port       int
	VCPUs      int
	MemoryMiB  int
	UEFI       bool
	DiskPath   string // overlay, from StorageVolGetPath
	DiskFormat string
	SeedPath   string // seed ISO, from StorageVolGetPath
	SerialLog  string // file the serial console is logged to, or ""
	Network    string
	Bridge     string
	VLAN       int
	MAC        string
}

func esc(s string) string {
	var b bytes.Buffer
	_ = xml.EscapeText(&b, []byte(s))
	return strings.ReplaceAll(b.String(), `'`, "&#39;")
}

// domainXML renders the domain definition: q35, file disks with the paths
// libvirt reported (AppArmor grants access to paths only, not to pool
// volumes), the seed CD-ROM on virtio-scsi, the guest-agent channel, the
// serial console (logged to a file when SerialLog is set) and the
// namespaced marker.
func domainXML(p domainParams) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("<domain type='%s'>\n", esc(p.Type))
	w("  <name>%s</name>\n", esc(p.Name))
	w("  <metadata>\n")
	w("    <%s:instance xmlns:%s='%s'>\n", metadataPrefix, metadataPrefix, MetadataURI)
	w("      <%s:proxy>%s</%s:proxy>\n", metadataPrefix, esc(p.Marker.ProxyID), metadataPrefix)
	w("      <%s:pool>%s</%s:pool>\n", metadataPrefix, esc(p.Marker.Pool), metadataPrefix)
	w("      <%s:entry>%s</%s:entry>\n", metadataPrefix, esc(p.Marker.Entry), metadataPrefix)
	w("      <%s:image>%s</%s:image>\n", metadataPrefix, esc(p.Image), metadataPrefix)
	w("      <%s:port>%d</%s:port>\n", metadataPrefix, p.Port, metadataPrefix)
	w("    </%s:instance>\n", metadataPrefix)
	w("  </metadata>\n")
	w("  <memory unit='MiB'>%d</memory>\n", p.MemoryMiB)
	w("  <vcpu>%d</vcpu>\n", p.VCPUs)
	if p.UEFI {
		w("  <os firmware='efi'>\n")
		w("    <type arch='x86_64' machine='q35'>hvm</type>\n")
		w("    <firmware>\n")
		w("      <feature enabled='no' name='secure-boot'/>\n")
		w("      <feature enabled='no' name='enrolled-keys'/>\n")
		w("    </firmware>\n")
		w("    <boot dev='hd'/>\n")
		w("  </os>\n")
	} else {
		w("  <os>\n")
		w("    <type arch='x86_64' machine='q35'>hvm</type>\n")
		w("    <boot dev='hd'/>\n")
		w("  </os>\n")
	}
	w("  <features>\n    <acpi/>\n    <apic/>\n  </features>\n")
	if p.Type == "kvm" {
		w("  <cpu mode='host-passthrough'/>\n")
	}
	w("  <on_poweroff>destroy</on_poweroff>\n  <on_reboot>restart</on_reboot>\n  <on_crash>destroy</on_crash>\n")
	w("  <devices>\n")
	w("    <disk type='file' device='disk'>\n")
	w("      <driver name='qemu' type='%s'/>\n", esc(p.DiskFormat))
	w("      <source file='%s'/>\n", esc(p.DiskPath))
	w("      <target dev='vda' bus='virtio'/>\n")
	w("    </disk>\n")
	// The seed CD-ROM hangs off virtio-scsi: cloud kernels (Debian's
	// linux-image-cloud-amd64) carry virtio drivers but no AHCI/SATA one.
	w("    <controller type='scsi' index='0' model='virtio-scsi'/>\n")
	w("    <disk type='file' device='cdrom'>\n")
	w("      <driver name='qemu' type='raw'/>\n")
	w("      <source file='%s'/>\n", esc(p.SeedPath))
	w("      <target dev='sda' bus='scsi'/>\n")
	w("      <readonly/>\n")
	w("    </disk>\n")
	if p.Bridge != "" {
		w("    <interface type='bridge'>\n")
		w("      <source bridge='%s'/>\n", esc(p.Bridge))
	} else {
		w("    <interface type='network'>\n")
		w("      <source network='%s'/>\n", esc(p.Network))
	}
	w("      <mac address='%s'/>\n", p.MAC)
	if p.VLAN > 0 {
		w("      <vlan>\n        <tag id='%d'/>\n      </vlan>\n", p.VLAN)
	}
	w("      <model type='virtio'/>\n")
	w("    </interface>\n")
	w("    <channel type='unix'>\n")
	w("      <target type='virtio' name='org.qemu.guest_agent.0'/>\n")
	w("    </channel>\n")
	if p.SerialLog != "" {
		// virtlogd writes what the guest prints on its first serial port
		// (its console) to the file, truncated at each start; the console
		// device still reaches it through the pty.
		w("    <serial type='pty'>\n")
		w("      <log file='%s' append='off'/>\n", esc(p.SerialLog))
		w("    </serial>\n")
	} else {
		w("    <serial type='pty'/>\n")
	}
	w("    <console type='pty'/>\n")
	w("    <rng model='virtio'>\n      <backend model='random'>/dev/urandom</backend>\n    </rng>\n")
	w("  </devices>\n")
	w("</domain>\n")
	return b.String()
}

// macFor derives a stable locally administered MAC (QEMU's 52:54:00 range)
// from the instance name, so the DHCP lease of a domain can be found again.
func macFor(name string) string {
	s := sha256.Sum256([]byte(name))
	return fmt.Sprintf("52:54:00:%02x:%02x:%02x", s[0], s[1], s[2])
}

// seedVolumeXML is a raw volume of exactly size bytes, filled by an upload.
func seedVolumeXML(name string, size uint64) string {
	return fmt.Sprintf("<volume>\n  <name>%s</name>\n  <capacity unit='bytes'>%d</capacity>\n  <allocation unit='bytes'>0</allocation>\n  <target>\n    <format type='raw'/>\n  </target>\n</volume>\n",
		esc(name), size)
}

// overlayVolumeXML is a qcow2 volume of capacity GiB backed by the base at
// basePath.
func overlayVolumeXML(name string, gib int, basePath, baseFormat string) string {
	return fmt.Sprintf("<volume>\n  <name>%s</name>\n  <capacity unit='GiB'>%d</capacity>\n  <target>\n    <format type='qcow2'/>\n  </target>\n  <backingStore>\n    <path>%s</path>\n    <format type='%s'/>\n  </backingStore>\n</volume>\n",
		esc(name), gib, esc(basePath), esc(baseFormat))
}
