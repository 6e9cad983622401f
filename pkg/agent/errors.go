package agent

import (
	"errors"
	"fmt"
)

// Error classes. Backends wrap upstream errors with [Classify]-able
// sentinels so errors.Is finds the class while the message keeps the
// upstream detail.
var (
	// ErrNotFound: the instance does not exist. On delete this is success.
	ErrNotFound = errors.New("not found")
	// ErrQuotaExceeded: the target cannot take this instance now; the planner
	// places the proxy elsewhere.
	ErrQuotaExceeded = errors.New("quota exceeded")
	// ErrTransient: retrying later may succeed.
	ErrTransient = errors.New("transient")
	// ErrPermanent: retrying will not help.
	ErrPermanent = errors.New("permanent")
)

// classError carries a class sentinel and the upstream error.
type classError struct {
	class error
	err   error
}

func (e *classError) Error() string   { return e.err.Error() }
func (e *classError) Unwrap() []error { return []error{e.class, e.err} }

// Wrap marks err with class (one of the sentinels). It returns nil for a nil
// err. The message is err's, unchanged.
func Wrap(class, err error) error {
	if err == nil {
		return nil
	}
	return &classError{class: class, err: err}
}

// Wrapf is [Wrap] around a formatted error.
func Wrapf(class error, format string, args ...any) error {
	return Wrap(class, fmt.Errorf(format, args...))
}

// Class names returned by [Classify].
const (
	ClassNotFound  = "not-found"
	ClassQuota     = "quota"
	ClassTransient = "transient"
	ClassPermanent = "permanent"
)

// Classify returns the class of err. Unclassified errors are transient:
// retrying is safer than latching a proxy as failed. When an error carries
// more than one class, the first of not-found, quota, transient and
// permanent wins: an explicit transient wrap overrides a permanent cause.
func Classify(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrNotFound):
		return ClassNotFound
	case errors.Is(err, ErrQuotaExceeded):
		return ClassQuota
	case errors.Is(err, ErrTransient):
		return ClassTransient
	case errors.Is(err, ErrPermanent):
		return ClassPermanent
	default:
		return ClassTransient
	}
}
