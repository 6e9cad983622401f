// Package access is who may use the console: the users file (one
// "name:role:bcrypt-hash" a line), the two roles, login sessions with
// random ids, and the CSRF token each session carries for its actions.
package access

import (
	"bufio"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// Role is what a user may do.
type Role string

// Roles: a viewer reads every page; an operator also acts (scale,
// recycle, report a ban, delete).
const (
	Viewer   Role = "viewer"
	Operator Role = "operator"
)

// CanAct reports whether r may perform actions.
func (r Role) CanAct() bool { return r == Operator }

// User is one line of the users file.
type User struct {
	Name string
	Role Role
	hash []byte
}

// Users are the console's users by name.
type Users map[string]User

var nameRE = regexp.MustCompile(`^[A-Za-z0-9._@-]{1,64}$`)

// ParseUsers reads a users file: one user a line, "name:role:hash", where
// role is viewer or operator and hash a bcrypt hash (console
// --hash-password makes one); blank lines and lines starting with # are
// skipped. file names the file in errors, which name the line.
func ParseUsers(r io.Reader, file string) (Users, error) {
	users := Users{}
	sc := bufio.NewScanner(r)
	n := 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, rest, ok1 := strings.Cut(line, ":")
		role, hash, ok2 := strings.Cut(rest, ":")
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%s line %d: want name:role:bcrypt-hash (role viewer or operator; console --hash-password makes the hash)", file, n)
		}
		if !nameRE.MatchString(name) {
			return nil, fmt.Errorf("%s line %d: user name %q: want 1-64 letters, digits, '.', '_', '@' or '-'", file, n, name)
		}
		switch Role(role) {
		case Viewer, Operator:
		default:
			if len(role) > 20 {
				role = role[:8] + "…" // a misplaced hash is not repeated whole
			}
			return nil, fmt.Errorf("%s line %d: user %s: role %q: want viewer or operator", file, n, name, role)
		}
		if _, err := bcrypt.Cost([]byte(hash)); err != nil {
			return nil, fmt.Errorf("%s line %d: user %s: the hash is not a bcrypt hash (make one with console --hash-password)", file, n, name)
		}
		if _, dup := users[name]; dup {
			return nil, fmt.Errorf("%s line %d: user %s appears twice", file, n, name)
		}
		users[name] = User{Name: name, Role: Role(role), hash: []byte(hash)}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if len(users) == 0 {
		return nil, fmt.Errorf("%s holds no user: add a line name:role:bcrypt-hash", file)
	}
	return users, nil
}

// LoadUsers reads the users file at path ([ParseUsers]).
func LoadUsers(path string) (Users, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("users file: %w", err)
	}
	defer f.Close()
	return ParseUsers(f, path)
}

// HashCost is the bcrypt cost of [HashPassword].
const HashCost = 12

// MinPasswordLen is the shortest password [HashPassword] accepts.
const MinPasswordLen = 10

// HashPassword returns the bcrypt hash of password for a users file line.
func HashPassword(password string) (string, error) {
	if len(password) < MinPasswordLen {
		return "", fmt.Errorf("the password is %d characters long: want at least %d", len(password), MinPasswordLen)
	}
	if len(password) > 72 {
		return "", errors.New("the password is longer than 72 bytes, which bcrypt cannot take")
	}
	h, err := bcrypt.GenerateFromPassword([]byte(password), HashCost)
	if err != nil {
		return "", err
	}
	return string(h), nil
}

// dummyHash is compared against when the name is unknown, so that a login
// takes as long whether the user exists or not: at the cost of the hashes
// HashPassword makes (made once, on the first unknown name).
var dummyHash = sync.OnceValue(func() []byte {
	h, _ := bcrypt.GenerateFromPassword([]byte("no such user, no such password"), HashCost)
	return h
})

// Check returns the user when name and password match one.
func (u Users) Check(name, password string) (User, bool) {
	usr, ok := u[name]
	hash := usr.hash
	if !ok {
		hash = dummyHash()
	}
	if bcrypt.CompareHashAndPassword(hash, []byte(password)) != nil || !ok {
		return User{}, false
	}
	return usr, true
}

// Session is one signed-in browser (or, in the open mode, one visitor).
type Session struct {
	ID   string
	User string
	Role Role
	// CSRF is the token every action of this session must carry.
	CSRF    string
	expires time.Time
	idle    time.Time
}

// CheckCSRF reports whether token is the session's.
func (s *Session) CheckCSRF(token string) bool {
	return token != "" && subtle.ConstantTimeCompare([]byte(token), []byte(s.CSRF)) == 1
}

// Sessions are the live sessions. It is safe for concurrent use.
type Sessions struct {
	// IdleTimeout ends a session unused this long; MaxAge any session
	// this old; Max bounds how many are kept (the oldest go first).
	IdleTimeout, MaxAge time.Duration
	Max                 int

	mu  sync.Mutex
	m   map[string]*Session
	now func() time.Time
}

// NewSessions returns an empty set of sessions with the defaults: 1 h idle,
// 12 h at most, 10,000 at once.
func NewSessions() *Sessions {
	return &Sessions{IdleTimeout: time.Hour, MaxAge: 12 * time.Hour, Max: 10_000, m: map[string]*Session{}, now: time.Now}
}

// Token returns 32 random bytes, base64url: a session id or CSRF token.
func Token() string {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("access: crypto/rand failed: " + err.Error()) // cannot happen on supported platforms
	}
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// New starts a session of user with role.
func (s *Sessions) New(user string, role Role) *Session {
	now := s.now()
	ss := &Session{ID: Token(), User: user, Role: role, CSRF: Token(), expires: now.Add(s.MaxAge), idle: now.Add(s.IdleTimeout)}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.m) >= s.Max {
		s.evictLocked(now)
	}
	s.m[ss.ID] = ss
	c := *ss
	return &c
}

// evictLocked drops the expired sessions, and the one closest to its end
// when none is.
func (s *Sessions) evictLocked(now time.Time) {
	var oldest *Session
	for id, ss := range s.m {
		if now.After(ss.expires) || now.After(ss.idle) {
			delete(s.m, id)
			continue
		}
		if oldest == nil || ss.idle.Before(oldest.idle) {
			oldest = ss
		}
	}
	if len(s.m) >= s.Max && oldest != nil {
		delete(s.m, oldest.ID)
	}
}

// Get returns the live session with id, and keeps it alive.
func (s *Sessions) Get(id string) (*Session, bool) {
	if id == "" {
		return nil, false
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := s.m[id]
	if ss == nil {
		return nil, false
	}
	if now.After(ss.expires) || now.After(ss.idle) {
		delete(s.m, id)
		return nil, false
	}
	ss.idle = now.Add(s.IdleTimeout)
	c := *ss
	return &c, true
}

// Valid reports whether the session with id is live, without keeping it
// alive: an open page's live updates do not count as use.
func (s *Sessions) Valid(id string) bool {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := s.m[id]
	return ss != nil && !now.After(ss.expires) && !now.After(ss.idle)
}

// End ends the session with id.
func (s *Sessions) End(id string) {
	s.mu.Lock()
	delete(s.m, id)
	s.mu.Unlock()
}
