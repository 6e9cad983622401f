// Package clients authenticates the gateway's clients against an htpasswd
// file of bcrypt hashes (htpasswd -B): the user of each line is the pool
// the password opens, or "*" for every pool. The file is read again when
// it changes; a password that matched is remembered for a few minutes, so
// bcrypt's cost is not paid per request.
package clients

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/htpasswd"
)

// remember is how long a matched password is accepted without bcrypt.
const remember = 5 * time.Minute

// recheck is how often, at most, the file's modification time is read.
const recheck = time.Second

// File authenticates against one htpasswd file.
type File struct {
	path string

	mu      sync.Mutex
	data    []byte
	mod     time.Time
	checked time.Time
	ok      map[[32]byte]time.Time
}

// Load reads path and checks that every line is user:bcrypt-hash.
func Load(path string) (*File, error) {
	f := &File{path: path, ok: map[[32]byte]time.Time{}}
	data, mod, err := read(path)
	if err != nil {
		return nil, err
	}
	f.data, f.mod, f.checked = data, mod, time.Now()
	return f, nil
}

func read(path string) ([]byte, time.Time, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("clients file: %w", err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("clients file: %w", err)
	}
	n := 0
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok || user == "" || !strings.HasPrefix(hash, "$2") {
			return nil, time.Time{}, fmt.Errorf("clients file %s line %d: want <pool or *>:<bcrypt hash> (htpasswd -B)", path, i+1)
		}
		n++
	}
	if n == 0 {
		return nil, time.Time{}, errors.New("clients file " + path + ": no entries")
	}
	return data, st.ModTime(), nil
}

// Allow reports whether password opens pool: the file has a line for the
// pool, or for "*", with a bcrypt hash of it.
func (f *File) Allow(pool, password string) bool {
	now := time.Now()
	f.mu.Lock()
	if now.Sub(f.checked) >= recheck {
		f.checked = now
		if st, err := os.Stat(f.path); err == nil && !st.ModTime().Equal(f.mod) {
			if data, mod, err := read(f.path); err == nil {
				f.data, f.mod = data, mod
				clear(f.ok)
			}
		}
	}
	data := f.data
	k := sha256.Sum256([]byte(pool + "\x00" + password))
	until, hit := f.ok[k]
	f.mu.Unlock()
	if hit && now.Before(until) {
		return true
	}
	if !htpasswd.Verify(data, pool, password) && !htpasswd.Verify(data, "*", password) {
		return false
	}
	f.mu.Lock()
	f.ok[k] = now.Add(remember)
	f.mu.Unlock()
	return true
}
