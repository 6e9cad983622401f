package local

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// stateKind tags a state file as ours; files without it are not state.
const stateKind = "proxyfleet.local.v1"

// Proxy modes.
const (
	modeBuiltin = "builtin"
	modeSquid   = "squid"
)

// state is the content of <state-dir>/<instance>.json.
type state struct {
	Kind       string       `json:"kind"`
	Name       string       `json:"name"`
	Marker     agent.Marker `json:"marker"`
	Bind       string       `json:"bind"`
	Port       int          `json:"port"`
	SourceAddr string       `json:"sourceAddr,omitempty"`
	Mode       string       `json:"mode"`
	Auth       bool         `json:"auth,omitempty"`
	// PID is 0 until the process has started. StartTime is its start time
	// in clock ticks since boot (/proc/<pid>/stat field 22), so a reused
	// pid is not mistaken for our process.
	PID       int    `json:"pid,omitempty"`
	StartTime uint64 `json:"startTime,omitempty"`
}

func (s *state) address() string { return joinHostPort(s.Bind, s.Port) }

// valid reports whether s is marked state for the file name.
func (s *state) valid(name string) bool {
	return s.Kind == stateKind && s.Name == name && s.Marker.ProxyID != "" &&
		s.Port > 0 && (s.Mode == modeBuiltin || s.Mode == modeSquid)
}

// stateStore reads and writes state files in one directory.
type stateStore struct{ dir string }

func (st stateStore) path(name string) string { return filepath.Join(st.dir, name+".json") }

// instanceDir holds an instance's auth, config and log files.
func (st stateStore) instanceDir(name string) string { return filepath.Join(st.dir, name) }

// errNoState means the instance has no state file.
var errNoState = errors.New("no state file")

// read returns the state of name, errNoState when there is none, or an
// error for a file that is not valid state.
func (st stateStore) read(name string) (*state, error) {
	b, err := os.ReadFile(st.path(name))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errNoState
	}
	if err != nil {
		return nil, err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil || !s.valid(name) {
		return nil, agent.Wrapf(agent.ErrPermanent, "%s is not proxyfleet state; it is left untouched", st.path(name))
	}
	return &s, nil
}

// write replaces the state of s.Name atomically: a crash leaves either the
// old or the new file, never a torn one.
func (st stateStore) write(s *state) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(st.dir, "."+s.Name+".json.tmp-*")
	if err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("write state: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("write state: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), st.path(s.Name)); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return syncDir(st.dir)
}

// remove deletes the state file of name; a missing file is not an error.
func (st stateStore) remove(name string) error {
	if err := os.Remove(st.path(name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return syncDir(st.dir)
}

// list returns every valid state in the directory, skipping everything
// else (other files, temp files, foreign JSON).
func (st stateStore) list() ([]*state, error) {
	entries, err := os.ReadDir(st.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []*state
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !e.Type().IsRegular() || !events.IsIdentifier(name) {
			continue
		}
		s, err := st.read(name)
		if err != nil {
			continue
		}
		out = append(out, s)
	}
	return out, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
