package agent

import (
	"flag"
	"net/netip"
	"strings"

	"proxyfleet/pkg/egress"
)

// EgressFlag registers --egress-allow on fs, the flag every agent shares:
// the address:port pairs its proxies may reach whatever the egress policy
// (the health service's echo endpoint, which the probes fetch through every
// proxy). It goes into [Config.EgressEndpoints].
func EgressFlag(fs *flag.FlagSet) *[]netip.AddrPort {
	var v endpointsValue
	fs.Var(&v, "egress-allow",
		"ip:port every proxy may reach despite the egress policy: the health echo endpoint the probes fetch (repeat or separate with commas)")
	return &v.eps
}

type endpointsValue struct{ eps []netip.AddrPort }

func (v *endpointsValue) String() string {
	if v == nil {
		return ""
	}
	return strings.Join(egress.FormatEndpoints(v.eps), ",")
}

func (v *endpointsValue) Set(s string) error {
	eps, err := egress.ParseEndpoints(strings.Split(s, ","))
	if err != nil {
		return err
	}
	v.eps = append(v.eps, eps...)
	return nil
}
