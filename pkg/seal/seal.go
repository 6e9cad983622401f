// Package seal keeps secrets out of streams and buckets that others can
// read: a box is encrypted to one holder's NATS curve (xkey) key, and only
// that holder opens it. Agents hold a key each (create commands carry the
// pool's secrets sealed to it); health holds one (the probe credentials
// are sealed to it). A key lives in a seed file, 0600, created on first use.
package seal

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/events"
)

// ErrWrongKey says a box was sealed to another key than the one trying to
// open it.
var ErrWrongKey = errors.New("sealed to another key")

// NewKey returns a new curve key pair, held in memory only.
func NewKey() (nkeys.KeyPair, error) { return nkeys.CreateCurveKeys() }

// LoadOrCreate returns the curve key whose seed is in path, creating the
// file (0600, its directory 0700) with a new key when it does not exist.
// Two processes starting at once on one path end with the same key, and a
// crash never leaves a partial file: the seed is written and synced to a
// temporary file first, which is then hard-linked to path (link(2) fails
// when path exists, so the loser reads the winner's whole file).
func LoadOrCreate(path string) (nkeys.KeyPair, error) {
	kp, err := Load(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return kp, err
	}
	kp, err = nkeys.CreateCurveKeys()
	if err != nil {
		return nil, fmt.Errorf("create a curve key: %w", err)
	}
	seed, err := kp.Seed()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("key directory: %w", err)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".new-*")
	if err != nil {
		return nil, fmt.Errorf("create key file: %w", err)
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }()
	_, werr := f.Write(append(seed, '\n'))
	if err := errors.Join(werr, f.Chmod(0o600), f.Sync(), f.Close()); err != nil {
		return nil, fmt.Errorf("write key file %s: %w", path, err)
	}
	if err := os.Link(tmp, path); errors.Is(err, fs.ErrExist) {
		return Load(path)
	} else if err != nil {
		return nil, fmt.Errorf("create key file %s: %w", path, err)
	}
	return kp, nil
}

// Load reads the curve key whose seed is in path. A file that others than
// its owner may read is refused: the key opens every secret sealed to it.
func Load(path string) (nkeys.KeyPair, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("key file %s has mode %04o: it must be readable by its owner only (chmod 600 %s)", path, fi.Mode().Perm(), path)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	kp, err := nkeys.FromCurveSeed(bytes.TrimSpace(raw))
	if err != nil {
		// Never echo the file's content: it may be a key of another kind.
		return nil, fmt.Errorf("key file %s does not hold a curve (xkey) seed starting with SX: %w", path, err)
	}
	return kp, nil
}

// Public returns kp's public key ("X…").
func Public(kp nkeys.KeyPair) string {
	pub, _ := kp.PublicKey()
	return pub
}

// CheckPublic reports whether pub is a curve public key.
func CheckPublic(pub string) error {
	if !strings.HasPrefix(pub, "X") || !nkeys.IsValidPublicCurveKey(pub) {
		return fmt.Errorf("%q is not a curve (xkey) public key", pub)
	}
	return nil
}

// Seal encrypts plain to the curve public key to, with a one-time sender
// key whose public half travels in the box.
func Seal(plain []byte, to string) (*events.Sealed, error) {
	if err := CheckPublic(to); err != nil {
		return nil, fmt.Errorf("seal: recipient %w", err)
	}
	eph, err := nkeys.CreateCurveKeys()
	if err != nil {
		return nil, fmt.Errorf("seal: %w", err)
	}
	defer eph.Wipe()
	box, err := eph.Seal(plain, to)
	if err != nil {
		return nil, fmt.Errorf("seal: %w", err)
	}
	return &events.Sealed{To: to, From: Public(eph), Box: box}, nil
}

// Open decrypts s with kp. A box sealed to another key fails with
// [ErrWrongKey]; a box that does not open (tampered, or not made by
// [Seal]) fails with a plain error. Neither error quotes the box.
func Open(kp nkeys.KeyPair, s *events.Sealed) ([]byte, error) {
	if s == nil {
		return nil, errors.New("no sealed box")
	}
	mine := Public(kp)
	if s.To != mine {
		return nil, fmt.Errorf("%w: the box is for %s, this key is %s", ErrWrongKey, s.To, mine)
	}
	if err := CheckPublic(s.From); err != nil {
		return nil, fmt.Errorf("open: sender %w", err)
	}
	plain, err := kp.Open(s.Box, s.From)
	if err != nil {
		return nil, fmt.Errorf("the box for %s does not open (%v): it was altered or not sealed by proxyfleet", mine, err)
	}
	return plain, nil
}
