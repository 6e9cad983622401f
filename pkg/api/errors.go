package api

import (
	"strconv"
	"strings"

	"proxyfleet/pkg/events"
)

// The refusals and failures the planner answers, one constructor a kind,
// so that a status always goes with its code.

// Invalid refuses a request that can be read but is not acceptable (422):
// the message joins the fields' errors.
func Invalid(fields []events.FieldError) *APIError {
	parts := make([]string, len(fields))
	for i := range fields {
		parts[i] = fields[i].Error()
	}
	return &APIError{Status: "422", Code: CodeInvalid, Message: strings.Join(parts, "; "), Fields: fields}
}

// Unprocessable refuses a well-formed request naming something that cannot
// be acted on (422), naming field, why and the value.
func Unprocessable(field, reason, value string) *APIError {
	return Invalid([]events.FieldError{{Field: field, Reason: reason, Value: value}})
}

// NotFound refuses a request naming a pool or proxy the planner does not
// know (422): field holds value, what says what it is not ("unknown pool").
func NotFound(field, what, value string) *APIError {
	return &APIError{Status: "422", Code: CodeNotFound, Message: field + ": " + what + " " + strconv.Quote(value),
		Fields: []events.FieldError{{Field: field, Reason: what, Value: value}}}
}

// Conflict answers a request whose aggregate kept changing while the
// planner decided (409).
func Conflict(msg string) *APIError {
	return &APIError{Status: "409", Code: CodeConflict, Message: msg}
}

// Internal answers a request the planner failed (500); msg says whether
// anything was recorded and what to do.
func Internal(msg string) *APIError {
	return &APIError{Status: "500", Code: CodeInternal, Message: msg}
}

// Unavailable answers a request that cannot be done now (503).
func Unavailable(msg string) *APIError {
	return &APIError{Status: "503", Code: CodeUnavailable, Message: msg}
}
