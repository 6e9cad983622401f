package forwardproxy

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
)

// ErrBadAuthFile is returned by [ReadAuthFile] for a file that is malformed
// or readable by others.
var ErrBadAuthFile = errors.New("bad auth file")

// FormatAuth returns the content of an auth file: one line
// "username:password". Write it with mode 0600.
func FormatAuth(c Credentials) []byte { return []byte(c.Username + ":" + c.Password + "\n") }

// ReadAuthFile reads credentials written by [FormatAuth]. The file must not
// be readable by group or others: it holds a password.
func ReadAuthFile(path string) (*Credentials, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%w: %s has mode %#o; it holds a password, make it 0600", ErrBadAuthFile, path, perm)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	line := string(bytes.TrimRight(b, "\r\n"))
	user, pass, ok := strings.Cut(line, ":")
	if !ok || user == "" || strings.ContainsAny(line, "\r\n") {
		return nil, fmt.Errorf("%w: %s must hold one line username:password", ErrBadAuthFile, path)
	}
	return &Credentials{Username: user, Password: pass}, nil
}
