package events

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
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

// UnmarshalJSON reads an envelope, keeping unknown attributes.
func (e *Envelope) UnmarshalJSON(b []byte) error {
	type plain Envelope
	var p plain
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	if onlyKnownAttrs(b) {
		// Most envelopes: a second decode, into a map, would find nothing.
		*e = Envelope(p)
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	for k, v := range m {
		if !knownAttrs[k] {
			if p.Extensions == nil {
				p.Extensions = map[string]json.RawMessage{}
			}
			p.Extensions[k] = v
		}
	}
	*e = Envelope(p)
	return nil
}

// onlyKnownAttrs reports whether b, valid JSON, is an object whose
// attribute names are all in knownAttrs. It scans names without decoding
// values; on anything it does not expect (an escaped name, say) it reports
// false, and the caller takes the long way.
func onlyKnownAttrs(b []byte) bool {
	i := skipSpace(b, 0)
	if i == len(b) || b[i] != '{' {
		return false
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return true
	}
	for i < len(b) && b[i] == '"' {
		j := i + 1
		for j < len(b) && b[j] != '"' && b[j] != '\\' {
			j++
		}
		if j == len(b) || b[j] != '"' || !knownAttrs[string(b[i+1:j])] {
			return false
		}
		i = skipSpace(b, j+1)
		if i == len(b) || b[i] != ':' {
			return false
		}
		var ok bool
		if i, ok = skipValue(b, skipSpace(b, i+1)); !ok {
			return false
		}
		i = skipSpace(b, i)
		if i < len(b) && b[i] == '}' {
			return true
		}
		if i == len(b) || b[i] != ',' {
			return false
		}
		i = skipSpace(b, i+1)
	}
	return false
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the index after the JSON value starting at i.
func skipValue(b []byte, i int) (int, bool) {
	depth := 0
	for i < len(b) {
		switch b[i] {
		case '"':
			for i++; i < len(b) && b[i] != '"'; i++ {
				if b[i] == '\\' {
					i++
				}
			}
			if i >= len(b) {
				return i, false
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i, true // the end of the enclosing object
			}
			depth--
		case ',':
			if depth == 0 {
				return i, true
			}
		}
		i++
		if depth == 0 && (b[i-1] == '"' || b[i-1] == '}' || b[i-1] == ']') {
			return i, true
		}
	}
	return i, depth == 0
}

// DecodeEnvelope parses and checks an envelope. Bad JSON and missing or
// invalid attributes return a [*DecodeError]; it never panics.
func DecodeEnvelope(b []byte) (Envelope, error) {
	var e Envelope
	// UnmarshalJSON directly: through json.Unmarshal the input would be
	// scanned once more before it.
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
