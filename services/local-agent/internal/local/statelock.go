package local

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// LockFile is the file in the state directory that the agent owning the
// directory holds an exclusive flock(2) on, and writes its pid into.
const LockFile = "local-agent.lock"

// ErrStateDirInUse is returned by [LockStateDir] when another agent holds
// the state directory.
var ErrStateDirInUse = errors.New("state directory in use")

// StateLock is an agent's hold on its state directory: two agents on one
// directory would hand out the same ports and adopt each other's processes.
type StateLock struct {
	f    *os.File
	path string
}

// LockStateDir creates dir if needed and takes the exclusive lock of
// <dir>/[LockFile] without waiting, writing this process's pid into it.
// The lock is the kernel's flock, released when the holder exits however it
// exits (kill -9 included), so a stale file never blocks a new agent. The
// file is opened close-on-exec: the proxies the agent starts do not inherit
// it. When another process holds it, the error wraps [ErrStateDirInUse] and
// names that process's pid and the directory.
func LockStateDir(dir string) (*StateLock, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("state directory %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	path := filepath.Join(abs, LockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o644)
	if err != nil {
		return nil, fmt.Errorf("state directory lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		defer f.Close()
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		holder := "another process"
		if b, rerr := os.ReadFile(path); rerr == nil {
			if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil && pid > 0 {
				holder = "local-agent pid " + strconv.Itoa(pid)
			}
		}
		return nil, fmt.Errorf("%w: %s is held by %s (lock %s); stop that agent, or give this one its own --state-dir or --data-dir",
			ErrStateDirInUse, abs, holder, path)
	}
	err = f.Truncate(0)
	if err == nil {
		_, err = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	if err != nil {
		f.Close() // closing releases the lock
		return nil, fmt.Errorf("write pid to %s: %w", path, err)
	}
	return &StateLock{f: f, path: path}, nil
}

// Release empties the lock file and releases the lock.
func (l *StateLock) Release() error {
	_ = l.f.Truncate(0)
	return l.f.Close()
}
