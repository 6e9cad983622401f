package events

import (
	"errors"
	"testing"
)

// Agents read a proxy's last event with the id a command names; a command
// whose proxy id breaks the identifier rule is refused, so no agent ever
// reads (or writes) an aggregate readers would skip.
func TestCommandsRefuseBadProxyIDs(t *testing.T) {
	for _, id := range []string{"Demo-abc", "demo_abc", "demo-", "", "a123456789012345678901234567890123456789012345678901234567890123"} {
		create := CreateCommand{ProxyID: id, ProxySpec: ProxySpec{Pool: "demo", Entry: "local", Target: "t1", Instance: InstanceName(id), Port: 3128}, Attempt: 1}
		del := DeleteCommand{ProxyID: id, Entry: "local", Target: "t1", Instance: InstanceName(id), Attempt: 1}
		for name, err := range map[string]error{"create": create.Validate(), "delete": del.Validate()} {
			var v *ValidationError
			if !errors.As(err, &v) || len(v.Fields) != 1 || v.Fields[0].Field != "proxyID" {
				t.Errorf("%s command for proxy %q: Validate() = %v; want one problem, with proxyID", name, id, err)
			}
		}
	}
}
