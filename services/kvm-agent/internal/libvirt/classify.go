package libvirt

import (
	"errors"
	"fmt"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
)

// classes maps libvirt error codes onto the agent's error classes. Codes
// not listed are transient: retrying is safer than latching a proxy failed.
var classes = map[golibvirt.ErrorNumber]error{
	golibvirt.ErrNoDomain:     agent.ErrNotFound,
	golibvirt.ErrNoStorageVol: agent.ErrNotFound,

	golibvirt.ErrNoStoragePool:        agent.ErrPermanent, // a configuration error: retrying will not create the pool
	golibvirt.ErrNoNetwork:            agent.ErrPermanent,
	golibvirt.ErrNoSupport:            agent.ErrPermanent,
	golibvirt.ErrInvalidArg:           agent.ErrPermanent,
	golibvirt.ErrXMLError:             agent.ErrPermanent,
	golibvirt.ErrAccessDenied:         agent.ErrPermanent,
	golibvirt.ErrAuthFailed:           agent.ErrPermanent,
	golibvirt.ErrConfigUnsupported:    agent.ErrPermanent,
	golibvirt.ErrOperationUnsupported: agent.ErrPermanent,
	golibvirt.ErrArgumentUnsupported:  agent.ErrPermanent,
	golibvirt.ErrNoSecurityModel:      agent.ErrPermanent,
	golibvirt.ErrInvalidDomain:        agent.ErrPermanent,
	golibvirt.ErrStorageProbeFailed:   agent.ErrPermanent,
	golibvirt.ErrInvalidStorageVol:    agent.ErrPermanent,
	golibvirt.ErrInvalidStoragePool:   agent.ErrPermanent,
	golibvirt.ErrNoDomainMetadata:     agent.ErrNotFound,
	golibvirt.ErrOperationTimeout:     agent.ErrTransient,
	golibvirt.ErrAgentUnresponsive:    agent.ErrTransient,
	golibvirt.ErrAgentUnsynced:        agent.ErrTransient,
	golibvirt.ErrResourceBusy:         agent.ErrTransient,
	golibvirt.ErrOperationInvalid:     agent.ErrTransient,
	golibvirt.ErrSystemError:          agent.ErrTransient,
	golibvirt.ErrRPC:                  agent.ErrTransient,
	golibvirt.ErrNoConnect:            agent.ErrTransient,
	golibvirt.ErrInternalError:        agent.ErrTransient,
	golibvirt.ErrOperationFailed:      agent.ErrTransient,
	golibvirt.ErrDomExist:             agent.ErrTransient,
	golibvirt.ErrStorageVolExist:      agent.ErrTransient,
	golibvirt.ErrNoMemory:             agent.ErrTransient,
	golibvirt.ErrHookScriptFailed:     agent.ErrTransient,
	golibvirt.ErrMigrateUnsafe:        agent.ErrPermanent,
	golibvirt.ErrNoServer:             agent.ErrTransient,
	golibvirt.ErrNoClient:             agent.ErrTransient,
	golibvirt.ErrAuthUnavailable:      agent.ErrTransient,
	golibvirt.ErrAuthCancelled:        agent.ErrPermanent,
	golibvirt.ErrOperationAborted:     agent.ErrTransient,
	golibvirt.ErrBlockCopyActive:      agent.ErrTransient,
}

// Error is a libvirt error as it crossed the seam: the function that
// failed, the libvirt code, and the message libvirtd sent.
type Error struct {
	RPC     string
	Code    uint32
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (libvirt %s, code %d)", e.RPC, e.Message, CodeName(e.Code), e.Code)
}

// CodeName returns the go-libvirt name of a libvirt error code.
func CodeName(code uint32) string { return golibvirt.ErrorNumber(code).String() }

// HasCode reports whether err carries libvirt error code code.
func HasCode(err error, code golibvirt.ErrorNumber) bool {
	var le *Error
	return errors.As(err, &le) && le.Code == uint32(code)
}

// IsNotFound reports whether err says the domain, volume or metadata asked
// for does not exist.
func IsNotFound(err error) bool {
	return HasCode(err, golibvirt.ErrNoDomain) || HasCode(err, golibvirt.ErrNoStorageVol) ||
		HasCode(err, golibvirt.ErrNoDomainMetadata)
}

// Classify wraps err with the agent error class of its libvirt code, keeping
// the message. Errors that already carry a class keep it; errors without a
// libvirt code (a broken connection, a timeout) are transient.
func Classify(err error) error {
	if err == nil {
		return nil
	}
	if classified(err) {
		return err
	}
	var le *Error
	if errors.As(err, &le) {
		if class, ok := classes[golibvirt.ErrorNumber(le.Code)]; ok {
			return agent.Wrap(class, err)
		}
	}
	return agent.Wrap(agent.ErrTransient, err)
}

// classified reports whether err already carries one of the agent classes.
func classified(err error) bool {
	return errors.Is(err, agent.ErrNotFound) || errors.Is(err, agent.ErrQuotaExceeded) ||
		errors.Is(err, agent.ErrTransient) || errors.Is(err, agent.ErrPermanent)
}

// fromLibvirt converts a go-libvirt error into an [*Error] naming rpc; other
// errors (transport failures) are returned unchanged.
func fromLibvirt(rpc string, err error) error {
	var ge golibvirt.Error
	if errors.As(err, &ge) {
		return &Error{RPC: rpc, Code: ge.Code, Message: ge.Message}
	}
	return err
}
