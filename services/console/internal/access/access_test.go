package access

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

func TestSessionsExpireAndAreBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	s := NewSessions()
	s.now = func() time.Time { return now }
	a := s.New("ana", Operator)
	if len(a.ID) < 40 || len(a.CSRF) < 40 || a.ID == a.CSRF {
		t.Fatalf("session id %q and token %q: want two long random values", a.ID, a.CSRF)
	}
	if got, ok := s.Get(a.ID); !ok || got.User != "ana" || !got.CheckCSRF(a.CSRF) || got.CheckCSRF("") || got.CheckCSRF(a.ID) {
		t.Fatalf("get: %+v %v", got, ok)
	}
	// Used within the idle time, it lives on; its age still ends it.
	for range 12 {
		now = now.Add(59 * time.Minute)
		if _, ok := s.Get(a.ID); !ok {
			t.Fatalf("a session used every 59 minutes ended at %v", now)
		}
	}
	now = now.Add(59 * time.Minute)
	if _, ok := s.Get(a.ID); ok {
		t.Fatal("a session lived past its 12 hours")
	}
	b := s.New("vic", Viewer)
	now = now.Add(30 * time.Minute)
	if !s.Valid(b.ID) {
		t.Fatal("a fresh session is not valid")
	}
	now = now.Add(31 * time.Minute) // Valid did not keep it alive
	if s.Valid(b.ID) {
		t.Fatal("a session unused for an hour is still valid")
	}
	c := s.New("ana", Operator)
	s.End(c.ID)
	if _, ok := s.Get(c.ID); ok {
		t.Fatal("an ended session is still there")
	}
	s.Max = 3
	var ids []string
	for range 5 {
		now = now.Add(time.Second)
		ids = append(ids, s.New("x", Viewer).ID)
	}
	if len(s.m) > 3 {
		t.Fatalf("%d sessions kept, want at most 3", len(s.m))
	}
	if _, ok := s.Get(ids[4]); !ok {
		t.Fatal("the newest session was evicted")
	}
}

func TestUsersCheck(t *testing.T) {
	h, _ := bcrypt.GenerateFromPassword([]byte("correct horse battery"), bcrypt.MinCost)
	u, err := ParseUsers(strings.NewReader("ana:operator:"+string(h)+"\n"), "f")
	if err != nil {
		t.Fatal(err)
	}
	if usr, ok := u.Check("ana", "correct horse battery"); !ok || usr.Role != Operator || !usr.Role.CanAct() {
		t.Fatalf("ana: %+v %v", usr, ok)
	}
	for _, tc := range [][2]string{{"ana", "wrong"}, {"bob", "correct horse battery"}, {"", ""}} {
		if _, ok := u.Check(tc[0], tc[1]); ok {
			t.Errorf("%q/%q signs in", tc[0], tc[1])
		}
	}
	if Viewer.CanAct() {
		t.Error("a viewer may act")
	}
}
