package kube

import (
	"strings"
	"testing"

	"proxyfleet/pkg/events"
)

func TestSquidConf(t *testing.T) {
	auth := &events.ProxyAuth{Username: "crawler", Password: "s3cret-canary"}
	conf := squidConf(8080, auth, "/usr/lib/squid/basic_ncsa_auth")
	for _, want := range []string{"http_port 8080\n", "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/proxyfleet/htpasswd\n", "http_access deny all\n", "pinger_enable off\n"} {
		if !strings.Contains(conf, want) {
			t.Errorf("squid.conf lacks %q:\n%s", want, conf)
		}
	}
	if strings.Contains(conf, "s3cret") {
		t.Errorf("the config holds the password:\n%s", conf)
	}
	if open := squidConf(3128, nil, "/x"); strings.Contains(open, "auth_param") || !strings.Contains(open, "http_access allow all") {
		t.Errorf("config without auth:\n%s", open)
	}
}
