package web

import (
	"net/http"
	"time"
)

type loginBody struct {
	Failed   bool
	Username string
}

// loginPage shows the sign-in form (the open mode has none).
func (s *Server) loginPage(w http.ResponseWriter, r *http.Request) {
	if s.open() {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.render(w, r, "login", http.StatusOK, time.Now(), s.newView(nil, "Sign in", "", loginBody{}))
}

// loginPost checks a user name and password against the users file and
// starts a session: a new id, so a fixed one cannot be planted.
func (s *Server) loginPost(w http.ResponseWriter, r *http.Request) {
	if s.open() {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxForm)
	if err := r.ParseForm(); err != nil || crossSite(r) {
		s.message(w, r, nil, http.StatusForbidden, "Refused", "Sign in from the console's own page.", "/login")
		return
	}
	name, password := r.PostForm.Get("username"), r.PostForm.Get("password")
	// At most a few bcrypt comparisons at once: each takes a core for a
	// while, and the console must keep serving its pages.
	select {
	case s.login <- struct{}{}:
	case <-r.Context().Done():
		return
	}
	u, ok := s.cfg.Users.Check(name, password)
	<-s.login
	if !ok {
		s.cfg.Log.Warn("a sign-in failed", "user", name)
		s.render(w, r, "login", http.StatusUnauthorized, time.Now(), s.newView(nil, "Sign in", "", loginBody{Failed: true, Username: name}))
		return
	}
	if c, err := r.Cookie(CookieName); err == nil {
		s.sessions.End(c.Value)
	}
	ss := s.sessions.New(u.Name, u.Role)
	setCookie(w, ss.ID)
	s.cfg.Log.Info("signed in", "user", u.Name, "role", string(u.Role))
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// logout ends the session (its CSRF token required, so another site
// cannot sign a user out).
func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxForm)
	ss := s.session(w, r)
	if ss == nil {
		http.Redirect(w, r, "/login", http.StatusSeeOther)
		return
	}
	if err := r.ParseForm(); err != nil || crossSite(r) || !ss.CheckCSRF(r.PostForm.Get("csrf")) {
		s.forbid(w, r, ss, "logout", "The CSRF token of this form is missing or wrong: reload the page and try again.")
		return
	}
	s.sessions.End(ss.ID)
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, Secure: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}
