// Package htpasswd writes the password lines of the htpasswd files Squid's
// basic_ncsa_auth helper reads: "user:hash", the hash bcrypt with the
// "$2y$" prefix Apache's htpasswd -B writes. Every backend that runs Squid
// (local-agent's squid mode, the Kubernetes Pods, the default cloud-init
// configuration) writes its file through this package; the password itself
// is never written anywhere.
//
// basic_ncsa_auth verifies bcrypt through the C library's crypt(3):
// glibc with libxcrypt (Debian 11 and later, Ubuntu 22.04 and later) and
// musl both implement it.
package htpasswd

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/bcrypt"
)

// Cost is the bcrypt cost of the hashes written. Squid runs the helper once
// per user and password it has not cached (credentialsttl, 2 hours by
// default), so the cost is paid rarely.
const Cost = 10

// MaxPasswordBytes is the longest password bcrypt hashes in full; longer
// ones are refused rather than silently truncated.
const MaxPasswordBytes = 72

// prefix is the bcrypt variant written: "$2y$", as htpasswd -B writes it,
// which every crypt_blowfish-derived verifier (libxcrypt, musl, Apache)
// reads as the corrected algorithm x/crypto/bcrypt computes. x/crypto
// labels its hashes "$2a$", a label some implementations verify with a
// countermeasure for passwords with 8-bit characters.
const prefix = "$2y$"

// CheckUser reports why user cannot name an htpasswd entry, or nil.
func CheckUser(user string) error {
	switch {
	case user == "":
		return errors.New("htpasswd: empty user name")
	case strings.ContainsAny(user, ":\r\n"):
		return fmt.Errorf("htpasswd: user name %q contains ':' or a line break", user)
	}
	return nil
}

// CheckPassword reports why password cannot be hashed, or nil. The
// password is never part of the error.
func CheckPassword(password string) error {
	switch {
	case password == "":
		return errors.New("htpasswd: empty password")
	case strings.ContainsAny(password, "\r\n"):
		return errors.New("htpasswd: the password contains a line break")
	case len(password) > MaxPasswordBytes:
		return fmt.Errorf("htpasswd: the password is %d bytes long; bcrypt takes at most %d", len(password), MaxPasswordBytes)
	}
	return nil
}

// Hash returns the "$2y$" bcrypt hash of password with a fresh random salt.
func Hash(password string) (string, error) {
	if err := CheckPassword(password); err != nil {
		return "", err
	}
	h, err := bcrypt.GenerateFromPassword([]byte(password), Cost)
	if err != nil {
		return "", fmt.Errorf("htpasswd: %w", err)
	}
	s := string(h)
	if len(s) < len(prefix) || s[0] != '$' || s[1] != '2' || s[3] != '$' {
		return "", fmt.Errorf("htpasswd: bcrypt returned an unexpected hash format")
	}
	return prefix + s[len(prefix):], nil
}

// Line returns "user:hash\n", one line of an htpasswd file.
func Line(user, password string) (string, error) {
	if err := CheckUser(user); err != nil {
		return "", err
	}
	h, err := Hash(password)
	if err != nil {
		return "", err
	}
	return user + ":" + h + "\n", nil
}

// Verify reports whether file (htpasswd lines, as Line or htpasswd -B
// write them) holds user with a bcrypt hash of password. Entries in other
// formats never match, and neither does a password Hash would refuse
// (bcrypt itself ignores bytes past the 72nd).
func Verify(file []byte, user, password string) bool {
	if CheckPassword(password) != nil {
		return false
	}
	for line := range strings.Lines(string(file)) {
		u, h, ok := strings.Cut(strings.TrimRight(line, "\r\n"), ":")
		if !ok || u != user || !strings.HasPrefix(h, "$2") {
			continue
		}
		return bcrypt.CompareHashAndPassword([]byte(h), []byte(password)) == nil
	}
	return false
}
