package site

import "testing"

func TestKey(t *testing.T) {
	for _, c := range []struct{ host, want string }{
		{"www.example.com", "example.com"},
		{"img.Example.COM:443", "example.com"},
		{"example.com.", "example.com"},
		{"shop.example.co.uk", "example.co.uk"},
		{"a.b.c.github.io", "c.github.io"},
		{"127.0.0.1:8443", "127.0.0.1"},
		{"[::1]:443", "::1"},
		{"[::ffff:10.0.0.1]:80", "10.0.0.1"},
		{"localhost:8080", "localhost"},
		{"co.uk", "co.uk"},
		{"", ""},
	} {
		if got := Key(c.host); got != c.want {
			t.Errorf("Key(%q) = %q, want %q", c.host, got, c.want)
		}
	}
}
