package kube

import (
	"context"
	"errors"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"proxyfleet/pkg/agent"
)

// classify wraps a client-go error with its class. A ResourceQuota refusal
// is a quota error (the planner places the proxy elsewhere); other
// refusals, invalid objects and bad requests are permanent; throttling,
// timeouts, conflicts and server errors are transient, as is anything
// unrecognised.
func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return agent.Wrap(agent.ErrTransient, err)
	case apierrors.IsNotFound(err):
		return agent.Wrap(agent.ErrNotFound, err)
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota"):
		return agent.Wrap(agent.ErrQuotaExceeded, err)
	case apierrors.IsTooManyRequests(err), apierrors.IsServerTimeout(err), apierrors.IsTimeout(err),
		apierrors.IsInternalError(err), apierrors.IsServiceUnavailable(err), apierrors.IsConflict(err),
		apierrors.IsUnexpectedServerError(err):
		return agent.Wrap(agent.ErrTransient, err)
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err), apierrors.IsInvalid(err),
		apierrors.IsBadRequest(err), apierrors.IsMethodNotSupported(err), apierrors.IsNotAcceptable(err),
		apierrors.IsRequestEntityTooLargeError(err), apierrors.IsAlreadyExists(err):
		return agent.Wrap(agent.ErrPermanent, err)
	}
	return agent.Wrap(agent.ErrTransient, err)
}
