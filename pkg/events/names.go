// Package events is the messaging contract of proxyfleet: the subjects every
// service publishes and subscribes to, the CloudEvents envelope, the typed
// commands and domain events, and the validation rules that every boundary
// applies to them.
//
// Nothing in this package does I/O. Subjects are built only by the functions
// in subjects.go; each documents its literal subject.
package events

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"regexp"
	"strings"
)

// identifierRE is the identifier rule. Entry, target, pool and image-key names
// become NATS subject tokens, file names and provider IDs, so they must all
// match it.
var identifierRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// IdentifierRule is the human-readable form of the identifier rule, used in
// error messages.
const IdentifierRule = "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"

// IsIdentifier reports whether s satisfies the identifier rule.
func IsIdentifier(s string) bool { return identifierRE.MatchString(s) }

// CheckIdentifier returns a [*FieldError] naming field when value breaks the
// identifier rule.
func CheckIdentifier(field, value string) *FieldError {
	if value == "" {
		return &FieldError{Field: field, Reason: "is required"}
	}
	if !IsIdentifier(value) {
		return &FieldError{Field: field, Reason: "must be " + IdentifierRule, Value: value}
	}
	return nil
}

var lowerBase32 = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// InstanceName returns the deterministic backend name of the instance behind
// proxy id: "px-" followed by 16 lowercase base32 characters of SHA-256(id).
// It is valid as a libvirt domain, Proxmox VM, GCE instance and Pod name, and
// it is what makes a retried create find the instance an earlier attempt made.
func InstanceName(proxyID string) string {
	sum := sha256.Sum256([]byte(proxyID))
	return "px-" + lowerBase32.EncodeToString(sum[:])[:16]
}

// proxyIDSuffixLen is the number of random base32 characters in a proxy id.
const proxyIDSuffixLen = 10

// NewProxyID returns a fresh proxy id for a member of pool: the pool name
// (shortened if needed) followed by '-' and 10 random lowercase base32
// characters. The result satisfies the identifier rule, so it is usable as a
// subject token and KV key.
func NewProxyID(pool string) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("events: crypto/rand failed: " + err.Error()) // cannot happen on supported platforms
	}
	suffix := lowerBase32.EncodeToString(b[:])[:proxyIDSuffixLen]
	prefix := pool
	if max := 63 - proxyIDSuffixLen - 1; len(prefix) > max {
		prefix = strings.TrimRight(prefix[:max], "-")
	}
	return prefix + "-" + suffix
}
