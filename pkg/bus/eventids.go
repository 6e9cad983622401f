package bus

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// JetStream drops a message whose Nats-Msg-Id it stored in the last
// duplicate window, whatever subject either was published on. With the
// deterministic ids events carry (a proxy's "running" after its first
// create is "<proxy>.running.1"), any writer could publish, on a subject
// of its own, a message with the id another writer is about to use, and
// the real append would be acknowledged as a duplicate and never stored:
// an agent suppressing another proxy's "running", or health's "unhealthy".
//
// So the Msg-Id of an event is its id followed by a keyed hash of the
// subject and the id, under a key only the writer holds (idKey): the same
// for every retry of the writer, including after a restart, and unknown
// to every other writer. The event's own id (the envelope's) is
// unchanged: readers and the planner's retry checks compare that.

// idSep separates an event's id from its key's mark in a Msg-Id.
const idSep = "~"

// markLen is the bytes of the keyed hash a Msg-Id keeps (128 bits).
const markLen = 16

// msgIDFor returns the Nats-Msg-Id of event id published on subject under
// key; with no key (a server without authentication, where every client
// is every identity) the id itself.
func msgIDFor(key []byte, subject, id string) string {
	if len(key) == 0 {
		return id
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(subject))
	m.Write([]byte{0})
	m.Write([]byte(id))
	return id + idSep + base64.RawURLEncoding.EncodeToString(m.Sum(nil)[:markLen])
}

// idKeyOf derives a writer's Msg-Id key from the secrets its connection
// authenticates with (the contents of its nkey seed or credentials file,
// its password or token, its TLS client key): every replica of one
// identity derives the same key, and no other identity can. It is nil
// when there is no secret.
func idKeyOf(secrets [][]byte) []byte {
	if len(secrets) == 0 {
		return nil
	}
	m := hmac.New(sha256.New, []byte("proxyfleet event Msg-Id key v1"))
	for _, s := range secrets {
		var n [8]byte
		for i, l := 0, uint64(len(s)); i < 8; i++ {
			n[i] = byte(l >> (8 * i))
		}
		m.Write(n[:])
		m.Write(s)
	}
	return m.Sum(nil)
}

// fileSecret appends the contents of file, when set, to secrets. A file
// that cannot be read is left out: connecting with it fails anyway, with
// the client's own error.
func fileSecret(secrets [][]byte, file string) [][]byte {
	if file == "" {
		return secrets
	}
	if b, err := os.ReadFile(file); err == nil {
		secrets = append(secrets, b)
	}
	return secrets
}

// idKeyFile is the file, in an embedding service's data directory, holding
// the Msg-Id key of the embedded server's own client, whose nkey is new at
// every start.
const idKeyFile = "event-id.key"

// embeddedIDKey reads the Msg-Id key kept in dir, creating it on first
// use (mode 0600), so the embedding service's ids stay the same across its
// restarts.
func embeddedIDKey(dir string) ([]byte, error) {
	path := filepath.Join(dir, idKeyFile)
	b, err := os.ReadFile(path)
	if err == nil && len(b) == 32 {
		return b, nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read the event id key %s: %w", path, err)
	}
	if err == nil {
		return nil, fmt.Errorf("the event id key %s holds %d bytes, not 32; remove it to make a new one", path, len(b))
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, err
	}
	// Written aside and linked into place: a crash leaves either no key or
	// a whole one, and a key made meanwhile by another process wins.
	tmp, err := os.CreateTemp(dir, idKeyFile+".*")
	if err != nil {
		return nil, fmt.Errorf("create the event id key in %s: %w", dir, err)
	}
	defer os.Remove(tmp.Name())
	_, werr := tmp.Write(key)
	if werr == nil {
		werr = tmp.Sync()
	}
	if cerr := tmp.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return nil, fmt.Errorf("write the event id key in %s: %w", dir, werr)
	}
	if err := os.Link(tmp.Name(), path); errors.Is(err, fs.ErrExist) {
		return embeddedIDKey(dir)
	} else if err != nil {
		return nil, fmt.Errorf("create the event id key %s: %w", path, err)
	}
	return key, nil
}
