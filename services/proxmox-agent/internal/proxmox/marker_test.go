package proxmox

import (
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/config"
)

func TestMarkerRoundTrip(t *testing.T) {
	m := agent.Marker{ProxyID: "web-abcdefghij", Pool: "web", Entry: "pve-home"}
	got, port, ok := parseDescription(description(m, 3128))
	if !ok || got != m || port != 3128 {
		t.Errorf("parseDescription = %+v, %d, %v; want %+v, 3128", got, port, ok, m)
	}
	// Proxmox VE may reorder tags and separate them with ',' or ' '.
	for _, s := range []string{tags(m), "pf-proxy-web-abcdefghij,pf-pool-web proxyfleet;pf-entry-pve-home"} {
		got, ok := parseTags(s)
		if !ok || got != m {
			t.Errorf("parseTags(%q) = %+v, %v; want %+v", s, got, ok, m)
		}
	}
	for _, s := range []string{"", "proxyfleet", "pf-proxy-x;pf-entry-y", "db;prod"} {
		if _, ok := parseTags(s); ok {
			t.Errorf("parseTags(%q) accepted an incomplete marker", s)
		}
	}
	if _, _, ok := parseDescription("someone's database\nowner: ops"); ok {
		t.Error("parseDescription accepted a description without the marker")
	}
}

func TestNetConfig(t *testing.T) {
	for _, tc := range []struct {
		current string
		vlan    int
		want    string
	}{
		{"", 4, "virtio,bridge=vmbr0,tag=4"},
		{"virtio=BC:24:11:00:00:01,bridge=vmbr1", 4, "virtio=BC:24:11:00:00:01,bridge=vmbr0,tag=4"},
		{"virtio=BC:24:11:00:00:01,bridge=vmbr1,firewall=1,tag=7", 4, "virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1,tag=4"},
		{"virtio=BC:24:11:00:00:01,bridge=vmbr0,tag=7,mtu=1400", 0, "virtio=BC:24:11:00:00:01,bridge=vmbr0,mtu=1400"},
		{"e1000=BC:24:11:00:00:02,bridge=vmbr0", 12, "e1000=BC:24:11:00:00:02,bridge=vmbr0,tag=12"},
	} {
		d := &Driver{cfg: &config.Config{Bridge: "vmbr0", VLANTag: tc.vlan}}
		if got := d.netConfig(tc.current); got != tc.want {
			t.Errorf("netConfig(%q) with VLAN %d = %q, want %q", tc.current, tc.vlan, got, tc.want)
		}
		if !sameNet(d.netConfig(tc.current), tc.want) {
			t.Errorf("sameNet(%q) false", tc.want)
		}
	}
}
