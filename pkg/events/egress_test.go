package events_test

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// TestPoolSpecEgress: every allowed range and port is checked, each
// problem naming its element; Public keeps the allowance (it is not a
// secret) as a copy; a create command validates it too.
func TestPoolSpecEgress(t *testing.T) {
	cases := []struct {
		eg   events.Egress
		want []string // exact messages, none when valid
	}{
		{events.Egress{AllowCIDRs: []string{"10.1.0.0/16", "192.168.4.7", "fd12::/16"}, AllowPorts: []int{8080, 1, 65535}}, nil},
		{events.Egress{AllowCIDRs: []string{"10.1.0.1/16"}}, []string{`egress.allowCIDRs[0]: has host bits set; write 10.1.0.0/16 (got "10.1.0.1/16")`}},
		{events.Egress{AllowCIDRs: []string{"10.0.0.0/8", "::ffff:10.0.0.0/104"}}, []string{`egress.allowCIDRs[1]: is an IPv4-mapped IPv6 range; write the IPv4 range (got "::ffff:10.0.0.0/104")`}},
		{events.Egress{AllowCIDRs: []string{"example.com"}, AllowPorts: []int{0}}, []string{
			`egress.allowCIDRs[0]: must be an IP address or a CIDR such as 10.1.0.0/16 (got "example.com")`,
			`egress.allowPorts[0]: must be between 1 and 65535 (got "0")`}},
		{events.Egress{AllowPorts: make([]int, events.MaxEgressAllows+1)}, nil}, // checked below
	}
	for i, c := range cases[:len(cases)-1] {
		spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Egress: &c.eg}
		spec.Normalize()
		got := fieldMessages(t, fmt.Sprintf("case %d", i), spec.Validate())
		if strings.Join(got, "\n") != strings.Join(c.want, "\n") {
			t.Errorf("case %d: got %q, want %q", i, got, c.want)
		}
		cmd := events.CreateCommand{
			ProxyID:   "demo-aaaaaaaaaa",
			ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName("demo-aaaaaaaaaa"), Port: 3128, Egress: &c.eg},
			Attempt:   1,
		}
		if (cmd.Validate() == nil) != (len(c.want) == 0) {
			t.Errorf("case %d: create command validation %v, want valid=%v", i, cmd.Validate(), len(c.want) == 0)
		}
	}
	long := cases[len(cases)-1].eg
	for i := range long.AllowPorts {
		long.AllowPorts[i] = 1000 + i
	}
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Egress: &long}
	if err := spec.Validate(); err == nil || !strings.Contains(err.Error(), "egress.allowPorts: may hold at most 64 ports") {
		t.Errorf("65 ports: %v", err)
	}

	eg := &events.Egress{AllowCIDRs: []string{"10.1.0.0/16"}, AllowPorts: []int{8080}}
	pub := events.PoolSpec{Name: "demo", Egress: eg}.Public()
	if pub.Egress == eg || pub.Egress.AllowCIDRs[0] != "10.1.0.0/16" || pub.Egress.AllowPorts[0] != 8080 {
		t.Errorf("Public egress: got %+v, want a copy of %+v", pub.Egress, eg)
	}
	pol, err := eg.Policy([]netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:8480")})
	if err != nil {
		t.Fatal(err)
	}
	if got := pol.Check(netip.MustParseAddr("10.1.2.3"), 8080, true); got != egress.RuleOK {
		t.Errorf("compiled policy refuses an allowed destination: %s", got)
	}
	if got := pol.Check(netip.MustParseAddr("127.0.0.1"), 8480, false); got != egress.RuleOK {
		t.Errorf("compiled policy refuses the endpoint: %s", got)
	}
	var none *events.Egress
	if def, err := none.Policy(nil); err != nil || def.Check(netip.MustParseAddr("10.1.2.3"), 443, true) != egress.RulePrivate {
		t.Errorf("nil egress: %v, want the default policy", err)
	}
}

// TestPoolSpecEgressHostItself: an allowed range that holds the host
// itself — loopback or unspecified, IPv4 or IPv6, or an IPv6 form carrying
// them — is refused naming the element and what it holds; a spec recorded
// before that check still reads (the log's pool and the planner's create
// command), and its policy still refuses the host.
func TestPoolSpecEgressHostItself(t *testing.T) {
	cidrs := []string{"10.0.0.0/8", "0.0.0.0/0", "127.0.0.0/8", "::", "::/0", "64:ff9b::/96", "::ffff:0:0:0/96", "127.0.0.2", "0.0.0.0/1"}
	want := map[int]string{
		1: "holds 127.0.0.0/8 (loopback)",
		2: "holds 127.0.0.0/8 (loopback)",
		3: "holds ::/128 (unspecified)",
		4: "holds ::1/128 (loopback)",
		5: "holds 64:ff9b::7f00:0/104 (loopback 127.0.0.0/8 in IPv6)",
		6: "holds ::ffff:0:7f00:0/104 (loopback 127.0.0.0/8 in IPv6)",
		7: "holds 127.0.0.0/8 (loopback)",
		8: "holds 127.0.0.0/8 (loopback)",
	}
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Egress: &events.Egress{AllowCIDRs: cidrs}}
	spec.Normalize()
	var ve *events.ValidationError
	if err := spec.Validate(); !errors.As(err, &ve) {
		t.Fatalf("Validate = %v, want the host's ranges refused", err)
	}
	if len(ve.Fields) != len(want) {
		t.Errorf("%d fields refused, want %d: %v", len(ve.Fields), len(want), ve)
	}
	for _, f := range ve.Fields {
		var i int
		if _, err := fmt.Sscanf(f.Field, "egress.allowCIDRs[%d]", &i); err != nil || want[i] == "" {
			t.Errorf("refused %s: %v", f.Field, f)
			continue
		}
		prefix := fmt.Sprintf("egress.allowCIDRs[%d]: %s, which no allowance opens", i, want[i])
		if got := f.Error(); !strings.HasPrefix(got, prefix) || !strings.HasSuffix(got, fmt.Sprintf("(got %q)", cidrs[i])) {
			t.Errorf("got %q, want it to start %q and name %q", got, prefix, cidrs[i])
		}
	}

	// Recorded before the check: the pool still reads, and so does the
	// planner's command; the host stays refused.
	recorded := events.PoolAppliedData{Spec: spec, Revision: 1}
	if err := recorded.Validate(); err != nil {
		t.Errorf("a recorded pool with such a range no longer reads: %v", err)
	}
	cmd := events.CreateCommand{
		ProxyID:   "demo-aaaaaaaaaa",
		ProxySpec: events.ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: events.InstanceName("demo-aaaaaaaaaa"), Port: 3128, Egress: spec.Egress},
		Attempt:   1,
	}
	if err := cmd.Validate(); err != nil {
		t.Errorf("the create command of a recorded pool: %v", err)
	}
	pol, err := spec.Egress.Policy(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"127.0.0.2", "0.0.0.0", "::", "::1", "64:ff9b::7f00:1"} {
		if got := pol.Check(netip.MustParseAddr(a), 443, true); got == egress.RuleOK {
			t.Errorf("the recorded allowance opens %s", a)
		}
	}
	if got := pol.Check(netip.MustParseAddr("10.1.2.3"), 443, true); got != egress.RuleOK {
		t.Errorf("the recorded allowance of 10.0.0.0/8: %s, want allowed", got)
	}
}
