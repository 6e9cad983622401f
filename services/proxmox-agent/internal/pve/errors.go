package pve

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"proxyfleet/pkg/agent"
)

// ErrVMIDTaken marks a clone that lost a race for its new VMID ("unable to
// create VM 105: config file already exists"). It is transient: the caller
// retries with another VMID.
var ErrVMIDTaken = errors.New("VMID already taken")

// TaskError is a task that ended with an exit status other than OK.
type TaskError struct {
	UPID       string
	Type       string
	ExitStatus string
	// Log holds the last lines of the task log.
	Log []string
}

func (e *TaskError) Error() string {
	s := fmt.Sprintf("task %s (%s) failed: %s", e.Type, e.UPID, e.ExitStatus)
	if len(e.Log) > 0 {
		s += "; log: " + strings.Join(e.Log, " | ")
	}
	return s
}

// Classify wraps err with its agent error class: lock timeouts and 5xx are
// transient; "config file already exists" is a VMID race ([ErrVMIDTaken],
// transient); a missing VM or volume is not-found; 401, 403, parameter errors
// (400), unknown URIs (501) and known dead ends (starting a template) are
// permanent. It classifies immediate API errors ([*APIError]) and task exit
// statuses ([*TaskError]) by the same rules. Other errors are returned
// unchanged (the agent treats them as transient).
func Classify(err error) error {
	var text string
	status := 0
	var ae *APIError
	var te *TaskError
	switch {
	case errors.As(err, &ae):
		text, status = ae.Message, ae.Status
	case errors.As(err, &te):
		text = te.ExitStatus + "\n" + strings.Join(te.Log, "\n")
	default:
		return err
	}
	lower := strings.ToLower(text)
	switch {
	case strings.Contains(lower, "config file already exists"):
		return agent.Wrap(agent.ErrTransient, wrapBoth(ErrVMIDTaken, err))
	case strings.Contains(lower, "can't lock file") || strings.Contains(lower, "got timeout") ||
		strings.Contains(lower, "is locked"):
		return agent.Wrap(agent.ErrTransient, err)
	case isNotFoundText(lower):
		return agent.Wrap(agent.ErrNotFound, err)
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		return agent.Wrap(agent.ErrPermanent, err)
	case status == http.StatusBadRequest || strings.Contains(lower, "parameter verification failed"):
		return agent.Wrap(agent.ErrPermanent, err)
	case status == http.StatusNotImplemented:
		return agent.Wrap(agent.ErrPermanent, err)
	case strings.Contains(lower, "can't start a vm if it's a template") ||
		strings.Contains(lower, "no such storage") || strings.Contains(lower, "storage '") && strings.Contains(lower, "does not exist") ||
		strings.Contains(lower, "permission check failed"):
		return agent.Wrap(agent.ErrPermanent, err)
	case strings.Contains(lower, "not enough space") || strings.Contains(lower, "no space left"):
		return agent.Wrap(agent.ErrQuotaExceeded, err)
	case status >= 500:
		return agent.Wrap(agent.ErrTransient, err)
	case te != nil:
		// A task failed for a reason not recognised above: retrying is
		// safer than latching the proxy as failed.
		return agent.Wrap(agent.ErrTransient, err)
	default:
		return err
	}
}

// isNotFoundText recognises the messages of a VM or volume that does not
// exist.
func isNotFoundText(lower string) bool {
	switch {
	case strings.Contains(lower, "storage '"):
		return false // a missing storage is a configuration problem, not a missing object
	case strings.Contains(lower, "configuration file") && strings.Contains(lower, "does not exist"),
		strings.Contains(lower, "no such vm"),
		strings.Contains(lower, "volume") && strings.Contains(lower, "does not exist"),
		strings.Contains(lower, "no such volume"),
		strings.Contains(lower, "no such file"):
		return true
	}
	return false
}

// bothError carries a marker sentinel and the original error.
type bothError struct {
	mark error
	err  error
}

func (e *bothError) Error() string   { return e.err.Error() }
func (e *bothError) Unwrap() []error { return []error{e.mark, e.err} }

func wrapBoth(mark, err error) error { return &bothError{mark: mark, err: err} }
