package events

import (
	"encoding/json"
	"strings"
)

// FieldError names one field that failed validation and why.
type FieldError struct {
	Field  string `json:"field"`
	Reason string `json:"reason"`
	Value  string `json:"value,omitempty"`
}

func (e *FieldError) Error() string {
	if e.Value != "" {
		return e.Field + ": " + e.Reason + " (got " + quote(e.Value) + ")"
	}
	return e.Field + ": " + e.Reason
}

func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// ValidationError collects every [FieldError] of one value, so a caller sees
// all problems at once rather than one per attempt.
type ValidationError struct {
	Fields []FieldError `json:"fields"`
}

// Add records a problem with field.
func (v *ValidationError) Add(field, reason, value string) {
	v.Fields = append(v.Fields, FieldError{Field: field, Reason: reason, Value: value})
}

// AddField records fe when it is not nil.
func (v *ValidationError) AddField(fe *FieldError) {
	if fe != nil {
		v.Fields = append(v.Fields, *fe)
	}
}

// Err returns v when it holds at least one problem, else nil.
func (v *ValidationError) Err() error {
	if len(v.Fields) == 0 {
		return nil
	}
	return v
}

func (v *ValidationError) Error() string {
	parts := make([]string, len(v.Fields))
	for i := range v.Fields {
		parts[i] = v.Fields[i].Error()
	}
	return "invalid: " + strings.Join(parts, "; ")
}
