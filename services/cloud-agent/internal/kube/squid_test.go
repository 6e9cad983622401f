package kube

import (
	"strings"
	"testing"

	"proxyfleet/pkg/events"
)

func TestAPR1MatchesOpenSSL(t *testing.T) {
	// Reference values from `openssl passwd -apr1 -salt <salt> <password>`.
	cases := []struct{ pw, salt, want string }{
		{"p@ss word", "abcdefgh", "$apr1$abcdefgh$aJUuGLjz3OI4ylHF//t5U1"},
		{"longer-password-than-sixteen-chars", "xY12", "$apr1$xY12$kf/TziFrANtHdduAShPyD0"},
	}
	for _, c := range cases {
		if got := apr1(c.pw, c.salt); got != c.want {
			t.Errorf("apr1(%q, %q) = %q, want %q", c.pw, c.salt, got, c.want)
		}
	}
}

func TestSquidConf(t *testing.T) {
	auth := &events.ProxyAuth{Username: "crawler", Password: "s3cret-canary"}
	conf := squidConf(8080, auth, "/usr/lib/squid/basic_ncsa_auth")
	for _, want := range []string{"http_port 8080\n", "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/proxyfleet/htpasswd\n", "http_access deny all\n"} {
		if !strings.Contains(conf, want) {
			t.Errorf("squid.conf lacks %q:\n%s", want, conf)
		}
	}
	line := htpasswdLine(auth)
	if strings.Contains(conf, "s3cret") || strings.Contains(line, "s3cret") || !strings.HasPrefix(line, "crawler:$apr1$") {
		t.Errorf("htpasswd line %q or config leaks the password or has the wrong form", line)
	}
	if open := squidConf(3128, nil, "/x"); strings.Contains(open, "auth_param") || !strings.Contains(open, "http_access allow all") {
		t.Errorf("config without auth:\n%s", open)
	}
}
