package cooldown

import (
	"slices"
	"testing"
	"time"
)

var t0 = time.Unix(1_700_000_000, 0)

func entry(proxy, site string, at, until time.Duration) Entry {
	return Entry{Proxy: proxy, Pool: "p", Site: site, Rule: "blocked", At: t0.Add(at), Until: t0.Add(until)}
}

// TestCooled: a proxy is cooled for its site only, from the pool it is
// in, until its Until exactly; the earliest end is reported.
func TestCooled(t *testing.T) {
	now := t0
	s := NewSet(time.Hour, func() time.Time { return now })
	s.Add(entry("a", "s1.com", 0, 10*time.Minute))
	s.Add(entry("b", "s1.com", 0, 5*time.Minute))
	s.Add(entry("c", "s2.com", 0, 10*time.Minute))
	q := entry("q-a", "s1.com", 0, time.Minute)
	q.Pool = "q"
	s.Add(q)
	cases := []struct {
		at    time.Duration
		pool  string
		site  string
		ids   []string
		first time.Duration
	}{
		{0, "p", "s1.com", []string{"a", "b"}, 5 * time.Minute},
		{0, "p", "s2.com", []string{"c"}, 10 * time.Minute},
		{0, "p", "s3.com", nil, -1},
		{0, "q", "s1.com", []string{"q-a"}, time.Minute},
		{5*time.Minute - time.Nanosecond, "p", "s1.com", []string{"a", "b"}, 5 * time.Minute},
		{5 * time.Minute, "p", "s1.com", []string{"a"}, 10 * time.Minute},
		{10 * time.Minute, "p", "s1.com", nil, -1},
	}
	for _, c := range cases {
		now = t0.Add(c.at)
		ids, first := s.Cooled(c.pool, c.site)
		slices.Sort(ids)
		want := time.Time{}
		if c.first >= 0 {
			want = t0.Add(c.first)
		}
		if !slices.Equal(ids, c.ids) || !first.Equal(want) {
			t.Errorf("at %s, %s %s: %v until %v; want %v until %v", c.at, c.pool, c.site, ids, first, c.ids, want)
		}
	}
}

// TestAdd: the later end wins; an extension counts from the first start;
// a new cooldown after one ended counts from its own start.
func TestAdd(t *testing.T) {
	now := t0
	s := NewSet(time.Hour, func() time.Time { return now })
	steps := []struct {
		now     time.Duration
		e       Entry
		changed bool
		at      time.Duration
		until   time.Duration
	}{
		{0, entry("a", "s1.com", 0, 10*time.Minute), true, 0, 10 * time.Minute},
		{time.Minute, entry("a", "s1.com", time.Minute, 5*time.Minute), false, 0, 10 * time.Minute},
		{2 * time.Minute, entry("a", "s1.com", 2*time.Minute, 20*time.Minute), true, 0, 20 * time.Minute},
		{30 * time.Minute, entry("a", "s1.com", 30*time.Minute, 40*time.Minute), true, 30 * time.Minute, 40 * time.Minute},
		{30 * time.Minute, Entry{Proxy: "a"}, false, 30 * time.Minute, 40 * time.Minute},
	}
	for i, c := range steps {
		now = t0.Add(c.now)
		if got := s.Add(c.e); got != c.changed {
			t.Errorf("step %d: Add = %v; want %v", i, got, c.changed)
		}
		es := s.Entries()
		if len(es) != 1 || !es[0].At.Equal(t0.Add(c.at)) || !es[0].Until.Equal(t0.Add(c.until)) {
			t.Errorf("step %d: entries %+v; want one from +%s to +%s", i, es, c.at, c.until)
		}
	}
	s.Remove("a", "s1.com")
	if es := s.Entries(); len(es) != 0 {
		t.Errorf("after Remove: %+v", es)
	}
}

// TestSites: distinct sites a proxy was cooled on within the window,
// ended cooldowns included; entries past their end and retain leave.
func TestSites(t *testing.T) {
	now := t0
	s := NewSet(time.Hour, func() time.Time { return now })
	s.Add(entry("a", "s1.com", 0, time.Minute))
	s.Add(entry("a", "s2.com", 10*time.Minute, 11*time.Minute))
	s.Add(entry("a", "s2.com", 10*time.Minute, 12*time.Minute))
	s.Add(entry("a", "s3.com", 50*time.Minute, 80*time.Minute))
	s.Add(entry("b", "s1.com", 0, time.Minute))
	cases := []struct {
		now    time.Duration
		proxy  string
		window time.Duration
		want   int
	}{
		{50 * time.Minute, "a", time.Hour, 3},
		{50 * time.Minute, "a", 45 * time.Minute, 2},
		{50 * time.Minute, "b", time.Hour, 1},
		{50 * time.Minute, "c", time.Hour, 0},
		{60 * time.Minute, "a", time.Hour, 2},
		{2 * time.Hour, "a", time.Hour, 0},
	}
	for _, c := range cases {
		now = t0.Add(c.now)
		if got := s.Sites(c.proxy, c.window); got != c.want {
			t.Errorf("at +%s, %s within %s: %d sites; want %d", c.now, c.proxy, c.window, got, c.want)
		}
	}
	// Adding prunes what ended and is older than retain (1h).
	now = t0.Add(2 * time.Hour)
	s.Add(entry("c", "s9.com", 2*time.Hour, 3*time.Hour))
	if es := s.Entries(); len(es) != 1 || es[0].Proxy != "c" {
		t.Errorf("after pruning: %+v; want only c's entry", es)
	}
}
