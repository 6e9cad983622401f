package route

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// fillLabelled adds proxies demo-eu-0…, demo-us-0… with region and
// country labels: n in region eu (country de), n in region us.
func fillLabelled(tb *Table, n int) {
	for i := range n {
		tb.Set(Proxy{ID: fmt.Sprintf("demo-eu-%d", i), Pool: "demo", Address: fmt.Sprintf("127.0.0.1:%d", 21000+i), Labels: map[string]string{"region": "eu", "country": "de"}})
		tb.Set(Proxy{ID: fmt.Sprintf("demo-us-%d", i), Pool: "demo", Address: fmt.Sprintf("127.0.0.1:%d", 22000+i), Labels: map[string]string{"region": "us", "country": "us"}})
	}
}

func mustParse(t *testing.T, user string) Target {
	t.Helper()
	target, err := ParseUser(user)
	if err != nil {
		t.Fatal(err)
	}
	return target
}

// TestPickBySelection: a selection is served only by proxies carrying
// every selected label; one no proxy carries is a SelectionError naming
// the labels; without a selection every proxy serves.
func TestPickBySelection(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	fillLabelled(tb, 3)
	tb.Set(Proxy{ID: "demo-bare", Pool: "demo", Address: "127.0.0.1:23000"})
	seen := map[string]int{}
	for range 30 {
		x, err := tb.Pick(mustParse(t, "demo.region-eu"))
		if err != nil {
			t.Fatal(err)
		}
		tb.Done(x)
		seen[x.ID]++
	}
	if len(seen) != 3 || seen["demo-eu-0"] != 10 || seen["demo-eu-1"] != 10 || seen["demo-eu-2"] != 10 {
		t.Errorf("region-eu picked %v; want the 3 eu proxies 10 times each", seen)
	}
	if x, err := tb.Pick(mustParse(t, "demo.region-us.country-us")); err != nil || !strings.HasPrefix(x.ID, "demo-us-") {
		t.Errorf("region-us.country-us: %+v, %v; want a us proxy", x, err)
	}
	all := map[string]bool{}
	for range 7 {
		x, _ := tb.Pick(Target{Pool: "demo"})
		all[x.ID] = true
	}
	if len(all) != 7 {
		t.Errorf("no selection picked %d proxies of 7", len(all))
	}
	for user, want := range map[string]string{
		"demo.region-mars":            `no ready proxy of pool "demo" has region=mars`,
		"demo.region-eu.country-us":   `no ready proxy of pool "demo" has country=us and region=eu`,
		"demo.region-EU.session-s1":   `no ready proxy of pool "demo" has region=EU`,
		"demo.provider-x.session-abc": `no ready proxy of pool "demo" has provider=x`,
	} {
		_, err := tb.Pick(mustParse(t, user))
		var serr *SelectionError
		if !errors.As(err, &serr) || !errors.Is(err, ErrNoProxy) || err.Error() != want {
			t.Errorf("%s: %v; want a SelectionError %q matching ErrNoProxy", user, err, want)
		}
	}
}

// TestSessionStaysWithinItsSelection: a session with a selection fails
// over, rotates and survives its proxy's leaving only among the proxies
// of its selection, and the same id with another selection is another
// session.
func TestSessionStaysWithinItsSelection(t *testing.T) {
	now := time.Unix(1000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{Session: &events.SessionRotation{MaxRequests: 2}})
	fillLabelled(tb, 3)
	eu := mustParse(t, "demo.region-eu.session-s1")
	us := mustParse(t, "demo.region-us.session-s1")
	var tried []string
	for i := range 12 {
		x, err := tb.Pick(eu, tried...)
		if err != nil {
			t.Fatalf("pick %d: %v", i, err)
		}
		tb.Done(x)
		if !strings.HasPrefix(x.ID, "demo-eu-") {
			t.Fatalf("pick %d of the eu session: %s, out of its selection", i, x.ID)
		}
		if i == 5 {
			tried = append(tried, x.ID) // failover: another eu proxy
		}
		if i == 8 {
			tb.Remove(x.ID) // its proxy leaves
		}
	}
	x, err := tb.Pick(us)
	if err != nil || !strings.HasPrefix(x.ID, "demo-us-") {
		t.Fatalf("the same id with region-us: %+v, %v; want a us proxy", x, err)
	}
	if _, ok := tb.Session("demo", eu.SessionKey()); !ok {
		t.Errorf("the eu session %q is gone after the us one was pinned", eu.SessionKey())
	}
	if eu.SessionKey() != "s1.region-eu" || mustParse(t, "demo.session-s1").SessionKey() != "s1" ||
		mustParse(t, "demo.region-eu.country-de.session-s1").SessionKey() != "s1.country-de.region-eu" {
		t.Errorf("session keys %q", eu.SessionKey())
	}
	// Every eu proxy excluded: no proxy is left, and none of another region
	// is taken instead.
	if x, err := tb.Pick(eu, "demo-eu-0", "demo-eu-1", "demo-eu-2"); err == nil {
		t.Errorf("with every eu proxy excluded the eu session got %s", x.ID)
	}
}
