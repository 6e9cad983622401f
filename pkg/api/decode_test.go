package api_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

const subject = "fleet.api.pool.get"

// errorReply is a reply as micro's Request.Error sends it.
func errorReply(status, text, body string) *nats.Msg {
	return &nats.Msg{Header: nats.Header{"Nats-Service-Error-Code": {status}, "Nats-Service-Error": {text}}, Data: []byte(body)}
}

func TestDecode(t *testing.T) {
	for _, c := range []struct {
		name string
		msg  *nats.Msg
		err  error
		// want is the *APIError Decode returns; fails says it returns
		// another error when want is nil; is are the errors it must match
		// with errors.Is.
		want      *api.APIError
		fails     bool
		is        []error
		retryable bool
		out       api.NameRequest
	}{
		{name: "reply", msg: &nats.Msg{Data: []byte(`{"name":"demo"}`)}, out: api.NameRequest{Name: "demo"}},
		{name: "bad request", msg: errorReply("400", "size: must be number", `{"error":{"code":"bad_request","message":"size: must be number","fields":[{"field":"size","reason":"must be number"}]}}`),
			want: &api.APIError{Status: "400", Code: api.CodeBadRequest, Message: "size: must be number", Fields: []events.FieldError{{Field: "size", Reason: "must be number"}}},
			is:   []error{api.ErrBadRequest}},
		{name: "invalid", msg: errorReply("422", "name: is required", `{"error":{"code":"invalid","message":"name: is required","fields":[{"field":"name","reason":"is required"}]}}`),
			want: &api.APIError{Status: "422", Code: api.CodeInvalid, Message: "name: is required", Fields: []events.FieldError{{Field: "name", Reason: "is required"}}},
			is:   []error{api.ErrInvalid}},
		{name: "not found", msg: errorReply("422", `id: unknown proxy "x"`, `{"error":{"code":"not_found","message":"id: unknown proxy \"x\"","fields":[{"field":"id","reason":"unknown proxy","value":"x"}]}}`),
			want: &api.APIError{Status: "422", Code: api.CodeNotFound, Message: `id: unknown proxy "x"`, Fields: []events.FieldError{{Field: "id", Reason: "unknown proxy", Value: "x"}}},
			is:   []error{api.ErrNotFound}},
		{name: "conflict", msg: errorReply("409", "the pool keeps changing concurrently; retry", `{"error":{"code":"conflict","message":"the pool keeps changing concurrently; retry"}}`),
			want: &api.APIError{Status: "409", Code: api.CodeConflict, Message: "the pool keeps changing concurrently; retry"},
			is:   []error{api.ErrConflict}},
		{name: "internal", msg: errorReply("500", "could not record the pool; retry", `{"error":{"code":"internal","message":"could not record the pool; retry"}}`),
			want: &api.APIError{Status: "500", Code: api.CodeInternal, Message: "could not record the pool; retry"},
			is:   []error{api.ErrInternal}, retryable: true},
		{name: "unavailable", msg: errorReply("503", "id: no target", `{"error":{"code":"unavailable","message":"id: no target"}}`),
			want: &api.APIError{Status: "503", Code: api.CodeUnavailable, Message: "id: no target"},
			is:   []error{api.ErrUnavailable}, retryable: true},
		{name: "error without a body", msg: errorReply("503", "overloaded", ""),
			want: &api.APIError{Status: "503", Code: api.CodeUnavailable, Message: "overloaded"},
			is:   []error{api.ErrUnavailable}, retryable: true},
		{name: "error with a body of another shape", msg: errorReply("500", "handler panicked", `oops`),
			want: &api.APIError{Status: "500", Code: api.CodeInternal, Message: "handler panicked"},
			is:   []error{api.ErrInternal}, retryable: true},
		{name: "4xx without a body", msg: errorReply("404", "no such endpoint", ""),
			want: &api.APIError{Status: "404", Code: api.CodeInvalid, Message: "no such endpoint"},
			is:   []error{api.ErrInvalid}},
		{name: "no responders", err: nats.ErrNoResponders,
			want: &api.APIError{Status: "503", Code: api.CodeUnavailable,
				Message: "no planner answers fleet.api.pool.get; start the planner, or check that this connection's account may request fleet.api.>"},
			is: []error{api.ErrUnavailable, api.ErrNoReply, nats.ErrNoResponders}, retryable: true},
		{name: "timeout", err: nats.ErrTimeout,
			want: &api.APIError{Status: "504", Code: api.CodeTimeout,
				Message: "no reply on fleet.api.pool.get in time; the request may or may not have been done: get the pool or proxy to see, or send it again"},
			is: []error{api.ErrTimeout, api.ErrNoReply, nats.ErrTimeout}, retryable: true},
		{name: "deadline", err: fmt.Errorf("request: %w", context.DeadlineExceeded),
			want: &api.APIError{Status: "504", Code: api.CodeTimeout,
				Message: "no reply on fleet.api.pool.get in time; the request may or may not have been done: get the pool or proxy to see, or send it again"},
			is: []error{api.ErrTimeout, api.ErrNoReply, context.DeadlineExceeded}, retryable: true},
		{name: "cancelled", err: context.Canceled, fails: true, is: []error{context.Canceled}},
		{name: "closed connection", err: nats.ErrConnectionClosed, fails: true, is: []error{nats.ErrConnectionClosed}},
		{name: "reply that does not decode", msg: &nats.Msg{Data: []byte(`{"name":3}`)}, fails: true},
		{name: "neither reply nor error", fails: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out api.NameRequest
			err := api.Decode(subject, c.msg, c.err, &out)
			if out != c.out {
				t.Errorf("decoded %+v, want %+v", out, c.out)
			}
			for _, target := range c.is {
				if !errors.Is(err, target) {
					t.Errorf("errors.Is(%v, %v) = false, want true", err, target)
				}
			}
			if c.msg != nil && errors.Is(err, api.ErrNoReply) {
				t.Errorf("errors.Is(%v, ErrNoReply) = true for a reply", err)
			}
			var aerr *api.APIError
			got := errors.As(err, &aerr)
			if c.want == nil {
				if got {
					t.Fatalf("got *APIError %+v, want none (err %v)", aerr, err)
				}
				if (err != nil) != c.fails {
					t.Fatalf("got error %v, want one: %v", err, c.fails)
				}
				return
			}
			if !got {
				t.Fatalf("got %v, want *APIError %+v", err, c.want)
			}
			if aerr.Status != c.want.Status || aerr.Code != c.want.Code || aerr.Message != c.want.Message || !reflect.DeepEqual(aerr.Fields, c.want.Fields) {
				t.Errorf("got %+v, want %+v", aerr, c.want)
			}
			if aerr.Retryable() != c.retryable {
				t.Errorf("Retryable() = %v, want %v", aerr.Retryable(), c.retryable)
			}
			for _, other := range []error{api.ErrBadRequest, api.ErrInvalid, api.ErrNotFound, api.ErrConflict, api.ErrInternal, api.ErrUnavailable, api.ErrTimeout} {
				if other.(*api.APIError).Code != c.want.Code && errors.Is(err, other) {
					t.Errorf("errors.Is(%v, %v) = true, want false", err, other)
				}
			}
		})
	}
}

// TestErrorBody: the error body's bytes are the planner's wire format;
// Status travels in the header only.
func TestErrorBody(t *testing.T) {
	for _, c := range []struct {
		err  *api.APIError
		want string
	}{
		{&api.APIError{Status: "422", Code: api.CodeInvalid, Message: "size: must be at least 0", Fields: []events.FieldError{{Field: "size", Reason: "must be at least 0", Value: "-1"}}},
			`{"error":{"code":"invalid","message":"size: must be at least 0","fields":[{"field":"size","reason":"must be at least 0","value":"-1"}]}}`},
		{&api.APIError{Status: "500", Code: api.CodeInternal, Message: "could not record the pool; retry"},
			`{"error":{"code":"internal","message":"could not record the pool; retry"}}`},
	} {
		if got := string(api.ErrorBody(c.err)); got != c.want {
			t.Errorf("ErrorBody(%+v):\n got %s\nwant %s", c.err, got, c.want)
		}
		err := api.Decode(subject, errorReply(c.err.Status, c.err.Message, string(api.ErrorBody(c.err))), nil, nil)
		var back *api.APIError
		if !errors.As(err, &back) || !reflect.DeepEqual(back, c.err) {
			t.Errorf("round trip: got %#v, want %#v", err, c.err)
		}
	}
}
