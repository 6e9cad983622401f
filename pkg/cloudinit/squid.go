package cloudinit

import (
	"bytes"
	"fmt"
	"strings"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
)

// OwnAddressesFile is where the guest lists its own addresses, for the
// egress policy's own-address rule; [OwnAddressesScript] keeps it current.
const OwnAddressesFile = "/etc/squid/proxyfleet-own-addresses"

// Paths of the own-address refresh: the script and the systemd unit that
// runs it every [OwnAddressesEvery].
const (
	OwnAddressesScriptPath = "/etc/proxyfleet/own-addresses.sh"
	OwnAddressesUnit       = "proxyfleet-own-addresses.service"
	OwnAddressesEvery      = 5 // seconds
)

// OwnAddressesScript lists the guest's own addresses into a file (its
// first argument, [OwnAddressesFile] by default) and reloads Squid when the
// list changed: a guest's addresses change after boot (a DHCP lease, an
// IPv6 temporary address, an alias IP added later), and Squid reads the
// file only when it (re)reads its configuration. Squid has no acl that
// matches "an address of this host" by itself, so the list is kept
// current instead. Every IPv4 address is listed with the IPv6 forms that
// carry it (egress.V4InV6). A failed listing changes nothing (set -e); a
// failed reload is retried at the next run, since the file Squid last
// loaded is kept beside it (".loaded").
const OwnAddressesScript = `#!/bin/sh
# proxyfleet: keep Squid's own-address acl current.
set -eu
f=${1:-` + OwnAddressesFile + `}
addrs=$(ip -o addr show | awk '{split($4, a, "/"); print a[1]}')
new=$(mktemp "$f.XXXXXX")
trap 'rm -f "$new"' EXIT
for a in 127.0.0.1 ::1 $addrs; do
	echo "$a"
	case $a in
	*.*) echo "::$a"; echo "::ffff:0:$a"; echo "64:ff9b::$a" ;;
	esac
done | sort -u >"$new"
if ! cmp -s "$new" "$f"; then
	chmod 0644 "$new"
	mv "$new" "$f"
fi
cmp -s "$f" "$f.loaded" && exit 0
systemctl try-reload-or-restart squid.service
cp "$f" "$f.loaded"
`

// ownAddressesUnit runs [OwnAddressesScript] every [OwnAddressesEvery]
// seconds, from one long-running loop rather than a timer: a timer would
// log every run.
var ownAddressesUnit = fmt.Sprintf(`[Unit]
Description=proxyfleet: keep Squid's own-address acl current
After=squid.service

[Service]
ExecStart=/bin/sh -c 'while :; do /bin/sh %s || echo "own addresses not refreshed"; sleep %d; done'
Restart=always
RestartSec=%d

[Install]
WantedBy=multi-user.target
`, OwnAddressesScriptPath, OwnAddressesEvery, OwnAddressesEvery)

// DefaultSquidUserData returns a #cloud-config document that turns a stock
// Debian cloud image into a Squid forward proxy listening on port, demanding
// basic auth when auth is set and enforcing the egress policy pol (the
// guest's own addresses are listed at boot and kept current after). It asks for the squid package
// (a no-op on an image that has it) without refreshing the package lists,
// so a golden image boots without reaching a mirror. It is used when a pool gives no
// user-data. The document carries the password only as a salted bcrypt hash
// (pkg/htpasswd), never in the clear; it is still treated as a secret like
// any user-data.
func DefaultSquidUserData(port int, auth *events.ProxyAuth, pol egress.Policy) ([]byte, error) {
	var htpasswdLine string
	if auth != nil {
		var err error
		if htpasswdLine, err = htpasswd.Line(auth.Username, auth.Password); err != nil {
			return nil, fmt.Errorf("default cloud-config: basic auth: %w", err)
		}
	}
	var conf strings.Builder
	fmt.Fprintf(&conf, "http_port %d\n", port)
	// Squid refuses to start on a host name it cannot resolve; the guest's
	// may not be in any DNS.
	conf.WriteString("visible_hostname proxyfleet\n")
	conf.WriteString(pol.SquidRules(egress.SquidOwn{File: OwnAddressesFile}))
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
	conf.WriteString(egress.SquidHideClient())
	conf.WriteString(egress.SquidMarkOwnErrors())
	conf.WriteString("cache deny all\n")
	conf.WriteString("access_log daemon:/var/log/squid/access.log squid\n")

	var setup strings.Builder
	setup.WriteString("#!/bin/sh\nset -e\n")
	if auth != nil {
		// The proxy group exists once the squid package is installed, after
		// write_files ran.
		setup.WriteString("install -m 0640 -o root -g proxy /etc/proxyfleet/htpasswd /etc/squid/proxyfleet.htpasswd\n")
		setup.WriteString("rm -f /etc/proxyfleet/htpasswd\n")
	}
	setup.WriteString("install -m 0644 /etc/proxyfleet/squid.conf /etc/squid/squid.conf\n")
	// The own-address acl: loopback and every address of the guest, now
	// and whenever they change.
	fmt.Fprintf(&setup, "sh %s\n", OwnAddressesScriptPath)
	setup.WriteString("systemctl enable squid\nsystemctl restart squid\n")
	fmt.Fprintf(&setup, "systemctl daemon-reload\nsystemctl enable --now %s\n", OwnAddressesUnit)

	var b bytes.Buffer
	b.WriteString("#cloud-config\n")
	b.WriteString("# proxyfleet default: a Squid forward proxy.\n")
	b.WriteString("packages:\n  - squid\n")
	b.WriteString("write_files:\n")
	writeFile(&b, "/etc/proxyfleet/squid.conf", "0644", conf.String())
	if auth != nil {
		writeFile(&b, "/etc/proxyfleet/htpasswd", "0600", htpasswdLine)
	}
	writeFile(&b, OwnAddressesScriptPath, "0755", OwnAddressesScript)
	writeFile(&b, "/etc/systemd/system/"+OwnAddressesUnit, "0644", ownAddressesUnit)
	writeFile(&b, "/etc/proxyfleet/setup-squid.sh", "0700", setup.String())
	b.WriteString("runcmd:\n  - [sh, /etc/proxyfleet/setup-squid.sh]\n")
	return b.Bytes(), nil
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
