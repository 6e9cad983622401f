package fleet

import (
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/events"
)

// refused explains err, the failure of a publish or subscription on
// subject (or on a subject subject begins, when it ends with '.'), when
// the server refused it: under deploy/nats each gateway is
// its own identity gateway-<name>, allowed only its own subjects, so a
// --name other than its identity's shows as a refusal naming the subject.
func (f *Fleet) refused(subject string, err error) error {
	last := f.conn.NC.LastError()
	quoted := `"` + subject
	if !strings.HasSuffix(subject, ".") {
		quoted += `"`
	}
	if !errors.Is(last, nats.ErrPermissionViolation) || !strings.Contains(last.Error(), quoted) {
		return err
	}
	shown := subject
	if strings.HasSuffix(shown, ".") {
		shown += "*"
	}
	return fmt.Errorf("the NATS server refuses gateway %s %s (%w): under deploy/nats a gateway may use only the subjects of its own identity gateway-<name>; start it with --name set to that name and its own seed (make deploy-secrets GATEWAYS=... writes one per gateway)", f.cfg.Name, shown, last)
}

// checkIdentity fails when the server refused the gateway's own endpoint
// subscription: the gateway runs under another gateway's identity.
func (f *Fleet) checkIdentity() error {
	if err := f.conn.NC.Flush(); err != nil {
		return nil // not a refusal; the connection reports itself
	}
	return f.refused(events.GatewayGroup(f.cfg.Name)+".", nil)
}
