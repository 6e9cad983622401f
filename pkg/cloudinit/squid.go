package cloudinit

import (
	"bytes"
	"fmt"
	"strings"

	"proxyfleet/pkg/events"
)

// DefaultSquidUserData returns a #cloud-config document that turns a stock
// Debian cloud image into a Squid forward proxy listening on port, demanding
// basic auth when auth is set (the password ends up only in the guest's
// htpasswd file). It is used when a pool gives no user-data. The result
// holds the password: it is a secret like any user-data.
func DefaultSquidUserData(port int, auth *events.ProxyAuth) []byte {
	var conf strings.Builder
	fmt.Fprintf(&conf, "http_port %d\n", port)
	if auth != nil {
		conf.WriteString("auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/proxyfleet.htpasswd\n")
		conf.WriteString("auth_param basic realm proxyfleet\n")
		conf.WriteString("acl proxyfleet_users proxy_auth REQUIRED\n")
		conf.WriteString("http_access allow proxyfleet_users\n")
		conf.WriteString("http_access deny all\n")
	} else {
		// The pool asked for no authentication: the proxy is open to whoever
		// reaches it, so it must sit on a network only the crawlers reach.
		conf.WriteString("http_access allow all\n")
	}
	conf.WriteString("via off\nforwarded_for delete\ncache deny all\n")
	conf.WriteString("access_log daemon:/var/log/squid/access.log squid\n")

	var setup strings.Builder
	setup.WriteString("#!/bin/sh\nset -e\n")
	if auth != nil {
		fmt.Fprintf(&setup, "htpasswd -ic /etc/squid/proxyfleet.htpasswd %s < /etc/proxyfleet/proxy-password\n", shellQuote(auth.Username))
		setup.WriteString("chown root:proxy /etc/squid/proxyfleet.htpasswd\nchmod 0640 /etc/squid/proxyfleet.htpasswd\n")
		setup.WriteString("rm -f /etc/proxyfleet/proxy-password\n")
	}
	setup.WriteString("install -m 0644 /etc/proxyfleet/squid.conf /etc/squid/squid.conf\n")
	setup.WriteString("systemctl enable squid\nsystemctl restart squid\n")

	var b bytes.Buffer
	b.WriteString("#cloud-config\n")
	b.WriteString("# proxyfleet default: a Squid forward proxy.\n")
	b.WriteString("package_update: true\n")
	b.WriteString("packages:\n  - squid\n")
	if auth != nil {
		b.WriteString("  - apache2-utils\n")
	}
	b.WriteString("write_files:\n")
	writeFile(&b, "/etc/proxyfleet/squid.conf", "0644", conf.String())
	if auth != nil {
		writeFile(&b, "/etc/proxyfleet/proxy-password", "0600", auth.Password)
	}
	writeFile(&b, "/etc/proxyfleet/setup-squid.sh", "0700", setup.String())
	b.WriteString("runcmd:\n  - [sh, /etc/proxyfleet/setup-squid.sh]\n")
	return b.Bytes()
}

func writeFile(b *bytes.Buffer, path, perm, content string) {
	fmt.Fprintf(b, "  - path: %s\n    permissions: %s\n    owner: root:root\n    content: %s\n",
		yamlString(path), yamlString(perm), yamlString(content))
}

// yamlString quotes s as a YAML double-quoted scalar, so no value can
// break out of its field and every value reads back as it was: '"' and '\'
// are escaped, and so is every character a YAML reader refuses as it
// stands (C0 and C1 controls, DEL, U+FFFE, U+FFFF) or reads as a line break
// (YAML 1.1's U+0085, U+2028, U+2029), and the byte order mark. A control
// character left raw makes cloud-init refuse the whole document. Invalid
// UTF-8 becomes U+FFFD, as in any JSON-decoded string.
func yamlString(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20, r >= 0x7f && r <= 0x9f, r == 0x2028, r == 0x2029, r == 0xfeff, r == 0xfffe, r == 0xffff:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'"'"'`) + "'"
}
