package local

import (
	"strconv"
	"strings"
	"testing"
)

// FuzzParsePortRange: the local-agent's --ports value. A range it accepts
// is the kernel's choice or 1 <= first <= last <= 65535, and its String
// parses back to the same range; a refusal quotes the value on one line.
func FuzzParsePortRange(f *testing.F) {
	for _, s := range []string{"20000-20999", "0", " 0 ", "1-65535", "30-20", "0-0", "1-1", "-", "1-2-3", "+1-+2", " 7 - 9 ", "65535-65536", "0x10-0x20", "\n0", "1-\n2"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParsePortRange(s)
		if err != nil {
			if r != (PortRange{}) {
				t.Fatalf("ParsePortRange(%q) = %v with its error %v", s, r, err)
			}
			if msg := err.Error(); strings.ContainsAny(msg, "\r\n") || !strings.Contains(msg, strconv.Quote(s)) {
				t.Fatalf("ParsePortRange(%q): error %q does not quote the value on one line", s, msg)
			}
			return
		}
		if r.Kernel() {
			if strings.TrimSpace(s) != "0" {
				t.Fatalf("ParsePortRange(%q) = the kernel's choice", s)
			}
		} else if r.First < 1 || r.First > r.Last || r.Last > 65535 || r.Size() != r.Last-r.First+1 {
			t.Fatalf("ParsePortRange(%q) = %+v (size %d), out of bounds", s, r, r.Size())
		}
		back, err := ParsePortRange(r.String())
		if err != nil || back != r {
			t.Fatalf("ParsePortRange(%q) = %v, whose String %q parses to %v, %v", s, r, r.String(), back, err)
		}
	})
}
