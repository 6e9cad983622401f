package main

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestParseAllowCIDRs(t *testing.T) {
	got, err := parseAllowCIDRs(" 127.0.0.0/8, 10.20.0.0/16,192.168.7.5,,")
	want := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.20.0.0/16"), netip.MustParsePrefix("192.168.7.5/32")}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("parseAllowCIDRs = %v, %v; want %v", got, err, want)
	}
	if got, err := parseAllowCIDRs(""); err != nil || got != nil {
		t.Errorf("parseAllowCIDRs(\"\") = %v, %v; want none", got, err)
	}
	if _, err := parseAllowCIDRs("10.0.0.1/8"); err == nil || !strings.Contains(err.Error(), "10.0.0.0/8") {
		t.Errorf("a range with host bits: %v; want the error to suggest 10.0.0.0/8", err)
	}
}
