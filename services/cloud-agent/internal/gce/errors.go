package gce

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"

	"proxyfleet/pkg/agent"
)

// Operation error codes and API error reasons this backend acts on.
const (
	codeQuotaExceeded         = "QUOTA_EXCEEDED"
	codeStockout              = "ZONE_RESOURCE_POOL_EXHAUSTED"
	codeStockoutWithDetails   = "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"
	codeResourceNotFound      = "RESOURCE_NOT_FOUND"
	codeResourceAlreadyExists = "RESOURCE_ALREADY_EXISTS"
	codeRateLimitExceeded     = "RATE_LIMIT_EXCEEDED"
	reasonQuotaExceeded       = "quotaExceeded"
	reasonNotFound            = "notFound"
	reasonAlreadyExists       = "alreadyExists"
	reasonRateLimitExceeded   = "rateLimitExceeded"
	reasonUserRateLimit       = "userRateLimitExceeded"
	reasonResourceNotReady    = "resourceNotReady"
	reasonBackendError        = "backendError"
	reasonInternalError       = "internalError"
)

// errAlreadyExists marks an insert that found an instance of the same name;
// the driver decides by the marker whether that is its own.
var errAlreadyExists = errors.New("already exists")

// classify wraps an error returned by a Compute API call with its class.
func classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return agent.Wrap(agent.ErrTransient, err)
	}
	var ge *googleapi.Error
	if !errors.As(err, &ge) {
		// Network failures and anything unrecognised are transient:
		// retrying is safer than latching a proxy as failed.
		return agent.Wrap(agent.ErrTransient, err)
	}
	for _, it := range ge.Errors {
		switch it.Reason {
		case reasonQuotaExceeded, codeStockout, codeStockoutWithDetails:
			return agent.Wrap(agent.ErrQuotaExceeded, err)
		case reasonRateLimitExceeded, reasonUserRateLimit, reasonResourceNotReady, reasonBackendError, reasonInternalError:
			return agent.Wrap(agent.ErrTransient, err)
		case reasonNotFound:
			return agent.Wrap(agent.ErrNotFound, err)
		case reasonAlreadyExists:
			return agent.Wrap(errAlreadyExists, err)
		}
	}
	switch {
	case ge.Code == http.StatusNotFound:
		return agent.Wrap(agent.ErrNotFound, err)
	case ge.Code == http.StatusConflict:
		return agent.Wrap(errAlreadyExists, err)
	case ge.Code == http.StatusTooManyRequests, ge.Code >= 500, ge.Code == http.StatusRequestTimeout:
		return agent.Wrap(agent.ErrTransient, err)
	case ge.Code >= 400:
		return agent.Wrap(agent.ErrPermanent, err)
	}
	return agent.Wrap(agent.ErrTransient, err)
}

// operationError turns the error of a DONE operation (which the client
// library returns as data, not as a Go error) into a classified error, or
// nil when the operation succeeded.
func operationError(op *compute.Operation) error {
	if op == nil || op.Error == nil || len(op.Error.Errors) == 0 {
		return nil
	}
	var msgs []string
	for _, e := range op.Error.Errors {
		msgs = append(msgs, e.Code+": "+e.Message)
	}
	err := fmt.Errorf("operation %s (%s %s) failed: %s", op.Name, op.OperationType, lastSegment(op.TargetLink), strings.Join(msgs, "; "))
	for _, e := range op.Error.Errors {
		switch e.Code {
		case codeQuotaExceeded, codeStockout, codeStockoutWithDetails:
			return agent.Wrap(agent.ErrQuotaExceeded, err)
		case codeResourceNotFound:
			return agent.Wrap(agent.ErrNotFound, err)
		case codeResourceAlreadyExists:
			return agent.Wrap(errAlreadyExists, err)
		case codeRateLimitExceeded:
			return agent.Wrap(agent.ErrTransient, err)
		}
	}
	switch c := op.HttpErrorStatusCode; {
	case c == http.StatusNotFound:
		return agent.Wrap(agent.ErrNotFound, err)
	case c == http.StatusTooManyRequests, c >= 500:
		return agent.Wrap(agent.ErrTransient, err)
	}
	return agent.Wrap(agent.ErrPermanent, err)
}

func lastSegment(s string) string {
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		return s[i+1:]
	}
	return s
}
