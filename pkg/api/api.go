// Package api is the planner's operator API as a contract: the request and
// reply types of the fleet-planner micro service (fleet.api.<noun>.<verb>),
// its error codes and error body, [Decode], which turns any reply into the
// reply type or an [*APIError], and [Client], a typed client over a NATS
// connection. The planner serves these types; the gateway, the tests and
// any tool call the API through [Client].
package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/events"
)

// Error codes: the Code of an [APIError].
const (
	// CodeBadRequest: the request cannot be read (status "400").
	CodeBadRequest = "bad_request"
	// CodeInvalid: the request can be read but is not acceptable (status
	// "422"); Fields say which values and why.
	CodeInvalid = "invalid"
	// CodeNotFound: the request names a pool or proxy the planner does not
	// know (status "422").
	CodeNotFound = "not_found"
	// CodeConflict: the aggregate kept changing while the planner decided
	// (status "409").
	CodeConflict = "conflict"
	// CodeInternal: the planner failed (status "500"); the message says
	// whether anything was recorded.
	CodeInternal = "internal"
	// CodeUnavailable: what the request needs is not there now (status
	// "503"): no target can take a replacement, an agent does not answer,
	// or no planner answers the request at all.
	CodeUnavailable = "unavailable"
	// CodeTimeout: no reply came within the request's time (status "504").
	// The planner never sends it: [Decode] makes it of a request that timed
	// out, whose outcome is unknown.
	CodeTimeout = "timeout"
)

// Sentinels for [errors.Is]: an [*APIError] matches the sentinel of its
// Code, whatever its message, so an error that crossed the wire still
// classifies.
var (
	ErrBadRequest  = &APIError{Code: CodeBadRequest}
	ErrInvalid     = &APIError{Code: CodeInvalid}
	ErrNotFound    = &APIError{Code: CodeNotFound}
	ErrConflict    = &APIError{Code: CodeConflict}
	ErrInternal    = &APIError{Code: CodeInternal}
	ErrUnavailable = &APIError{Code: CodeUnavailable}
	ErrTimeout     = &APIError{Code: CodeTimeout}
)

// ErrNoReply matches, with [errors.Is], the error of a request no planner
// answered: no responders and timeouts, whatever their Code. Such a request
// can be sent again, for instance while a planner starts.
var ErrNoReply = errors.New("no reply from a planner")

// APIError is the body of an error reply, {"error": APIError}, and the
// error a [Client] returns for it. Status is the micro error code the
// reply carries in its Nats-Service-Error-Code header: "400" for a request
// that cannot be read, "422" for one that can but is not acceptable, "409"
// for a conflict, "5xx" when the planner failed or could not do it now.
type APIError struct {
	// Status is the micro error code; it travels in the header, never in
	// the JSON body.
	Status  string              `json:"-"`
	Code    string              `json:"code"`
	Message string              `json:"message"`
	Fields  []events.FieldError `json:"fields,omitempty"`

	// err is the request's own error when no reply came (no responders,
	// timeout).
	err error
}

func (e *APIError) Error() string { return e.Code + ": " + e.Message }

// Unwrap returns the request's error behind an error no planner sent
// (nats.ErrNoResponders, context.DeadlineExceeded, nats.ErrTimeout), or nil.
func (e *APIError) Unwrap() error { return e.err }

// Is reports whether target is an *APIError of the same Code (see the
// Err sentinels), or [ErrNoReply] for an error no planner sent.
func (e *APIError) Is(target error) bool {
	if target == ErrNoReply {
		return e.err != nil
	}
	t, ok := target.(*APIError)
	return ok && t.Code == e.Code
}

// Retryable reports whether the same request may succeed when sent again:
// the planner failed or could not do it now (5xx), or no reply came. A
// refusal (4xx) stands until the request or the fleet changes.
func (e *APIError) Retryable() bool { return !strings.HasPrefix(e.Status, "4") }

// errorBody is the JSON body of an error reply.
type errorBody struct {
	Error *APIError `json:"error"`
}

// ErrorBody returns the JSON body of the error reply for e:
// {"error":{"code":…,"message":…,"fields":[…]}}.
func ErrorBody(e *APIError) []byte {
	b, _ := json.Marshal(errorBody{Error: e})
	return b
}

// Decode turns the outcome of one request to subject — the reply msg and
// the error the request returned — into the reply decoded into out (nil to
// ignore the body) or an error. It is the one reader of the micro error
// headers (through [ReplyError]):
//
//   - an error reply is an [*APIError] with the Status of its
//     Nats-Service-Error-Code header and the code, message and fields of
//     its body (the header's text when the body holds none);
//   - no responders is an [*APIError] [CodeUnavailable] (status "503")
//     wrapping nats.ErrNoResponders;
//   - a request that timed out is an [*APIError] [CodeTimeout] (status
//     "504") wrapping the request's error;
//   - any other request error (a closed connection, a cancelled context)
//     is returned wrapped, naming subject.
func Decode(subject string, msg *nats.Msg, err error, out any) error {
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return &APIError{Status: "503", Code: CodeUnavailable, err: err,
			Message: "no planner answers " + subject + "; start the planner, or check that this connection's account may request fleet.api.>"}
	case errors.Is(err, nats.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return &APIError{Status: "504", Code: CodeTimeout, err: err,
			Message: "no reply on " + subject + " in time; the request may or may not have been done: get the pool or proxy to see, or send it again"}
	case err != nil:
		return fmt.Errorf("%s: %w", subject, err)
	case msg == nil:
		return fmt.Errorf("%s: no reply and no error", subject)
	}
	if aerr := ReplyError(msg); aerr != nil {
		return aerr
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(msg.Data, out); err != nil {
		return fmt.Errorf("%s: the reply does not decode: %w", subject, err)
	}
	return nil
}

// ReplyError returns the error an error reply of a micro service carries
// (the planner's, an agent's), nil for a reply that is not one: the
// Status of its Nats-Service-Error-Code header and the code, message and
// fields of its body, or the header's text when the body holds none. It
// is the one reader of the micro error headers.
func ReplyError(msg *nats.Msg) *APIError {
	status := msg.Header.Get(micro.ErrorCodeHeader)
	if status == "" {
		return nil
	}
	var body errorBody
	if json.Unmarshal(msg.Data, &body) != nil || body.Error == nil || body.Error.Code == "" {
		body.Error = &APIError{Code: codeOf(status), Message: msg.Header.Get(micro.ErrorHeader)}
	}
	body.Error.Status = status
	return body.Error
}

// codeOf is the Code of an error reply whose body names none (not sent by
// the planner: the micro framework's own refusals).
func codeOf(status string) string {
	switch {
	case status == "400":
		return CodeBadRequest
	case status == "409":
		return CodeConflict
	case status == "503":
		return CodeUnavailable
	case strings.HasPrefix(status, "4"):
		return CodeInvalid
	default:
		return CodeInternal
	}
}
