package events

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Label limits: a target carries at most MaxLabels labels, each key and
// value 1 to MaxLabelLen bytes of [LabelRule].
const (
	MaxLabels   = 16
	MaxLabelLen = 63
)

// LabelRule is the human-readable form of the rule label keys and values
// follow, used in error messages.
const LabelRule = "1-63 lowercase letters, digits, '-' or '_'"

// IsLabel reports whether s is a valid label key or value.
func IsLabel(s string) bool {
	if s == "" || len(s) > MaxLabelLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '_' {
			return false
		}
	}
	return true
}

// CheckLabels adds a problem to v for every key or value of labels that
// breaks [LabelRule] and for more than [MaxLabels] labels, each named by
// field ("labels.region"), in key order.
func CheckLabels(v *ValidationError, field string, labels map[string]string) {
	if len(labels) > MaxLabels {
		v.Add(field, fmt.Sprintf("holds %d labels; at most %d are allowed", len(labels), MaxLabels), "")
	}
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		if !IsLabel(k) {
			v.Add(field, "every key must be "+LabelRule, k)
			continue
		}
		if val := labels[k]; !IsLabel(val) {
			v.Add(field+"."+k, "must be "+LabelRule, val)
		}
	}
}

// ParseLabels reads labels written "key=value,key=value" (spaces around
// each pair are ignored; an empty string is no labels) and checks them
// against [LabelRule]. A key given twice is an error.
func ParseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	var v ValidationError
	for pair := range strings.SplitSeq(s, ",") {
		pair = strings.TrimSpace(pair)
		k, val, ok := strings.Cut(pair, "=")
		if !ok {
			v.Add("labels", "each label must be key=value", pair)
			continue
		}
		if _, dup := out[k]; dup {
			v.Add("labels", "key "+quote(k)+" is given twice", pair)
			continue
		}
		out[k] = val
	}
	CheckLabels(&v, "labels", out)
	if err := v.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// FormatLabels writes labels as [ParseLabels] reads them, in key order.
func FormatLabels(labels map[string]string) string {
	parts := make([]string, 0, len(labels))
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		parts = append(parts, k+"="+labels[k])
	}
	return strings.Join(parts, ",")
}

// MergeLabels returns base with over's labels added, over winning on a
// key both hold; nil when both are empty. Neither argument is changed.
func MergeLabels(base, over map[string]string) map[string]string {
	if len(base) == 0 && len(over) == 0 {
		return nil
	}
	out := make(map[string]string, len(base)+len(over))
	maps.Copy(out, base)
	maps.Copy(out, over)
	return out
}
