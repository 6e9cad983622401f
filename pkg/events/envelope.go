package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"
)

// SpecVersion is the CloudEvents version of every envelope.
const SpecVersion = "1.0"

// SchemaVersion is the version suffix of every envelope type. A reader
// accepts any envelope whose type carries a version it knows.
const SchemaVersion = "v1"

// typePrefix starts every envelope type: "proxyfleet.<kind>.<name>.v1".
const typePrefix = "proxyfleet."

// Envelope is a CloudEvents 1.0 event in structured JSON mode. Attributes the
// reader does not know (extensions added by a newer writer) are kept in
// Extensions and written back unchanged.
type Envelope struct {
	SpecVersion     string          `json:"specversion"`
	ID              string          `json:"id"`
	Source          string          `json:"source"`
	Type            string          `json:"type"`
	Subject         string          `json:"subject,omitempty"`
	Time            time.Time       `json:"time"`
	DataContentType string          `json:"datacontenttype,omitempty"`
	Data            json.RawMessage `json:"data,omitempty"`

	// Extensions holds every attribute not listed above, raw.
	Extensions map[string]json.RawMessage `json:"-"`
}

var knownAttrs = map[string]bool{
	"specversion": true, "id": true, "source": true, "type": true,
	"subject": true, "time": true, "datacontenttype": true, "data": true,
}

// EnvelopeType returns the CloudEvents type for a kind ("proxy", "pool",
// "cmd") and name: "proxyfleet.<kind>.<name>.v1".
func EnvelopeType(kind, name string) string {
	return typePrefix + kind + "." + name + "." + SchemaVersion
}

// NewEnvelope builds an envelope carrying data encoded as JSON. id must be
// deterministic for the fact it records: it doubles as the Nats-Msg-Id that
// makes a retried publish a no-op.
func NewEnvelope(id, source, typ, subject string, now time.Time, data any) (Envelope, error) {
	raw, err := json.Marshal(data)
	if err != nil {
		return Envelope{}, fmt.Errorf("encode %s data: %w", typ, err)
	}
	return Envelope{
		SpecVersion:     SpecVersion,
		ID:              id,
		Source:          source,
		Type:            typ,
		Subject:         subject,
		Time:            now.UTC(),
		DataContentType: "application/json",
		Data:            raw,
	}, nil
}

// MarshalJSON writes the known attributes and every kept extension.
func (e Envelope) MarshalJSON() ([]byte, error) {
	type plain Envelope
	base, err := json.Marshal(plain(e))
	if err != nil || len(e.Extensions) == 0 {
		return base, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(base, &m); err != nil {
		return nil, err
	}
	for k, v := range e.Extensions {
		if !knownAttrs[k] {
			m[k] = v
		}
	}
	return json.Marshal(m)
}

// UnmarshalJSON reads an envelope, keeping unknown attributes. b is checked
// by one scan and split into attributes by a second, light one that relies
// on that check: known attributes are converted from their raw values, and
// data and unknown attributes are kept raw, in one copy of b. Attribute
// names match exactly, as CloudEvents names are lower-case.
func (e *Envelope) UnmarshalJSON(b []byte) error {
	if !json.Valid(b) {
		var m map[string]json.RawMessage
		return json.Unmarshal(b, &m) // the syntax error, with its offset
	}
	buf := bytes.Clone(b)
	i := skipSpace(buf, 0)
	if buf[i] == 'n' { // null
		*e = Envelope{}
		return nil
	}
	if buf[i] != '{' {
		var m map[string]json.RawMessage
		return json.Unmarshal(b, &m) // the type error
	}
	var out Envelope
	for i = skipSpace(buf, i+1); buf[i] != '}'; i = skipSpace(buf, i) {
		if buf[i] == ',' {
			i = skipSpace(buf, i+1)
		}
		end := stringEnd(buf, i)
		key := buf[i:end]
		i = skipSpace(buf, skipSpace(buf, end)+1) // past the colon
		end = valueEnd(buf, i)
		v := json.RawMessage(buf[i:end:end])
		i = end
		name := key[1 : len(key)-1]
		if bytes.IndexByte(name, '\\') >= 0 || !utf8.Valid(name) {
			var unquoted string
			if err := json.Unmarshal(key, &unquoted); err != nil {
				return err
			}
			name = []byte(unquoted)
		}
		var err error
		switch string(name) {
		case "specversion":
			err = unmarshalString(v, &out.SpecVersion)
		case "id":
			err = unmarshalString(v, &out.ID)
		case "source":
			err = unmarshalString(v, &out.Source)
		case "type":
			err = unmarshalString(v, &out.Type)
		case "subject":
			err = unmarshalString(v, &out.Subject)
		case "datacontenttype":
			err = unmarshalString(v, &out.DataContentType)
		case "time":
			out.Time = time.Time{} // a repeated attribute replaces the earlier one, null included
			err = out.Time.UnmarshalJSON(v)
		case "data":
			out.Data = v
		default:
			if out.Extensions == nil {
				out.Extensions = map[string]json.RawMessage{}
			}
			out.Extensions[string(name)] = v
		}
		if err != nil {
			return fmt.Errorf("attribute %q: %w", name, err)
		}
	}
	*e = out
	return nil
}

// The scanners below walk JSON that json.Valid accepted.

// skipSpace returns the index of the first byte at or after i that is not
// JSON white space.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// isDelimiter reports whether c ends a number or a literal.
func isDelimiter(c byte) bool {
	switch c {
	case ',', '}', ']', ' ', '\t', '\n', '\r':
		return true
	}
	return false
}

// stringEnd returns the index just past the string that starts at i.
func stringEnd(b []byte, i int) int {
	for i++; ; i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
}

// valueEnd returns the index just past the value that starts at i.
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for {
			switch b[i] {
			case '"':
				i = stringEnd(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
	}
	for i < len(b) && !isDelimiter(b[i]) {
		i++
	}
	return i
}

// unmarshalString sets *s from the raw JSON value v; null sets "", so that
// a repeated attribute replaces the earlier one, as the last of duplicate
// keys does in a JSON object decoded as a whole. A string without escapes,
// the common case, is taken as it stands.
func unmarshalString(v json.RawMessage, s *string) error {
	*s = ""
	if n := len(v); n >= 2 && v[0] == '"' && v[n-1] == '"' {
		inner := v[1 : n-1]
		if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
			*s = string(inner)
			return nil
		}
	}
	return json.Unmarshal(v, s)
}

// DecodeEnvelope parses and checks an envelope. Bad JSON and missing or
// invalid attributes return a [*DecodeError]; it never panics.
func DecodeEnvelope(b []byte) (Envelope, error) {
	var e Envelope
	if err := e.UnmarshalJSON(b); err != nil {
		return Envelope{}, &DecodeError{Reason: "envelope is not valid JSON", Err: err}
	}
	var v ValidationError
	if e.SpecVersion != SpecVersion {
		v.Add("specversion", fmt.Sprintf("must be %q", SpecVersion), e.SpecVersion)
	}
	if e.ID == "" {
		v.Add("id", "is required", "")
	}
	if e.Source == "" {
		v.Add("source", "is required", "")
	}
	if e.Type == "" {
		v.Add("type", "is required", "")
	}
	if err := v.Err(); err != nil {
		return Envelope{}, &DecodeError{Reason: "invalid envelope", Err: err}
	}
	return e, nil
}

// DecodeData decodes the envelope's data into out, which must be a pointer.
// Fields added by a newer writer are ignored; wrong types return a
// [*DecodeError] naming the field.
func (e Envelope) DecodeData(out any) error {
	if len(e.Data) == 0 {
		return &DecodeError{Reason: e.Type + ": data is missing"}
	}
	if err := json.Unmarshal(e.Data, out); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return &DecodeError{Reason: fmt.Sprintf("%s: field %q must be %s, got %s", e.Type, te.Field, te.Type, te.Value), Err: err}
		}
		return &DecodeError{Reason: e.Type + ": data is not valid JSON", Err: err}
	}
	if v, ok := out.(interface{ Validate() error }); ok {
		if err := v.Validate(); err != nil {
			return &DecodeError{Reason: e.Type + ": invalid data", Err: err}
		}
	}
	return nil
}

// DecodeError reports a message that could not be decoded. Reason is safe to
// show; Err keeps the detail.
type DecodeError struct {
	Reason string
	Err    error
}

func (e *DecodeError) Error() string {
	if e.Err == nil {
		return e.Reason
	}
	return e.Reason + ": " + e.Err.Error()
}

func (e *DecodeError) Unwrap() error { return e.Err }
