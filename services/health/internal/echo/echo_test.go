package echo_test

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.uber.org/goleak"

	"proxyfleet/services/health/internal/echo"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHandlerReturnsCallerIP(t *testing.T) {
	srv := httptest.NewServer(echo.Handler())
	defer srv.Close()
	// Dial from 127.0.0.2 (loopback on Linux) so the answer cannot be a
	// constant that happens to match.
	for _, src := range []string{"127.0.0.1", "127.0.0.2"} {
		tr := &http.Transport{DialContext: (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}).DialContext}
		resp, err := (&http.Client{Transport: tr}).Get(srv.URL + "/")
		if err != nil {
			t.Fatalf("from %s: %v", src, err)
		}
		var body struct{ IP string }
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		tr.CloseIdleConnections()
		if err != nil {
			t.Fatalf("from %s: %v", src, err)
		}
		if body.IP != src {
			t.Errorf("from %s: got ip %q, want %q", src, body.IP, src)
		}
	}
}

func TestHandlerRejectsOtherMethods(t *testing.T) {
	rec := httptest.NewRecorder()
	echo.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Fatalf("POST: got %d, want 405", rec.Code)
	}
}

func TestURL(t *testing.T) {
	for _, tc := range []struct{ addr, want string }{
		{"127.0.0.1:8480", "http://127.0.0.1:8480/"},
		{":8480", "http://127.0.0.1:8480/"},
		{"0.0.0.0:8480", "http://127.0.0.1:8480/"},
		{"[::]:8480", "http://127.0.0.1:8480/"},
		{"10.1.2.3:80", "http://10.1.2.3:80/"},
	} {
		if got := echo.URL(tc.addr); got != tc.want {
			t.Errorf("URL(%q) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}
