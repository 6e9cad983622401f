package kube

import (
	"crypto/md5"
	"crypto/rand"
	"fmt"
	"strings"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// Paths inside the Squid container; the Pod's Secret is mounted at configDir.
const (
	configDir    = "/etc/proxyfleet"
	squidConfKey = "squid.conf"
	htpasswdKey  = "htpasswd"
)

// squidConf returns the Squid configuration of one proxy: listening on port,
// enforcing the egress policy pol, demanding basic auth when auth is set,
// logging to the container's streams, caching nothing and hiding the
// client. The Pod's own address is private in every cluster network
// proxyfleet supports, so the private rules cover it.
func squidConf(port int, auth *events.ProxyAuth, authHelper string, pol egress.Policy) string {
	var b strings.Builder
	fmt.Fprintf(&b, "http_port %d\n", port)
	b.WriteString(pol.SquidRules(""))
	b.WriteString("pid_filename none\n")
	b.WriteString("cache_log /dev/stderr\n")
	b.WriteString("access_log stdio:/dev/stdout squid\n")
	b.WriteString("cache deny all\nvia off\nforwarded_for delete\n")
	if auth != nil {
		fmt.Fprintf(&b, "auth_param basic program %s %s/%s\n", authHelper, configDir, htpasswdKey)
		b.WriteString("auth_param basic realm proxyfleet\n")
		b.WriteString("acl proxyfleet_users proxy_auth REQUIRED\n")
		b.WriteString("http_access allow proxyfleet_users\n")
		b.WriteString("http_access deny all\n")
	} else {
		// The pool asked for no authentication: the proxy is open to whoever
		// reaches the Pod, so network policy must fence it.
		b.WriteString("http_access allow all\n")
	}
	return b.String()
}

// htpasswdLine returns "user:$apr1$salt$hash", a line Squid's
// basic_ncsa_auth accepts; the password itself is never stored.
func htpasswdLine(auth *events.ProxyAuth) string {
	var raw [8]byte
	if _, err := rand.Read(raw[:]); err != nil {
		panic("kube: crypto/rand failed: " + err.Error()) // cannot happen on supported platforms
	}
	salt := make([]byte, 8)
	for i, c := range raw {
		salt[i] = itoa64[int(c)%len(itoa64)]
	}
	return auth.Username + ":" + apr1(auth.Password, string(salt)) + "\n"
}

const itoa64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// apr1 is Apache's MD5-based password hash ("$apr1$").
func apr1(password, salt string) string {
	const magic = "$apr1$"
	pw := []byte(password)
	d := md5.New()
	d.Write(pw)
	d.Write([]byte(magic))
	d.Write([]byte(salt))
	alt := md5.Sum([]byte(password + salt + password))
	for i := len(pw); i > 0; i -= 16 {
		d.Write(alt[:min(i, 16)])
	}
	for i := len(pw); i > 0; i >>= 1 {
		if i&1 != 0 {
			d.Write([]byte{0})
		} else {
			d.Write(pw[:1])
		}
	}
	final := d.Sum(nil)
	for i := range 1000 {
		h := md5.New()
		if i&1 != 0 {
			h.Write(pw)
		} else {
			h.Write(final)
		}
		if i%3 != 0 {
			h.Write([]byte(salt))
		}
		if i%7 != 0 {
			h.Write(pw)
		}
		if i&1 != 0 {
			h.Write(final)
		} else {
			h.Write(pw)
		}
		final = h.Sum(nil)
	}
	var out strings.Builder
	out.WriteString(magic + salt + "$")
	to64 := func(v uint32, n int) {
		for ; n > 0; n-- {
			out.WriteByte(itoa64[v&0x3f])
			v >>= 6
		}
	}
	f := func(i int) uint32 { return uint32(final[i]) }
	to64(f(0)<<16|f(6)<<8|f(12), 4)
	to64(f(1)<<16|f(7)<<8|f(13), 4)
	to64(f(2)<<16|f(8)<<8|f(14), 4)
	to64(f(3)<<16|f(9)<<8|f(15), 4)
	to64(f(4)<<16|f(10)<<8|f(5), 4)
	to64(f(11), 2)
	return out.String()
}
