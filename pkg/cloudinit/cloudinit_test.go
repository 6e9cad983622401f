package cloudinit

import (
	"bytes"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kdomanski/iso9660"
	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
)

// readISO returns the label and the files of the root directory of img.
func readISO(t *testing.T, img []byte) (string, map[string][]byte) {
	t.Helper()
	im, err := iso9660.OpenImage(bytes.NewReader(img))
	if err != nil {
		t.Fatalf("open iso: %v", err)
	}
	label, err := im.Label()
	if err != nil {
		t.Fatalf("label: %v", err)
	}
	root, err := im.RootDir()
	if err != nil {
		t.Fatalf("root: %v", err)
	}
	children, err := root.GetChildren()
	if err != nil {
		t.Fatalf("children: %v", err)
	}
	files := map[string][]byte{}
	for _, c := range children {
		if c.IsDir() {
			continue
		}
		b, err := io.ReadAll(c.Reader())
		if err != nil {
			t.Fatalf("read %s: %v", c.Name(), err)
		}
		files[c.Name()] = b
	}
	return label, files
}

func TestBuildISOContents(t *testing.T) {
	userData := [][]byte{
		[]byte("#cloud-config\nversion: 1.10\n# comment kept\nz: 1\na: 2\n"),
		[]byte("#!/bin/sh\necho hi\n"),
		[]byte("## template: jinja\n#cloud-config\nhostname: {{ v1.local_hostname }}\n"),
		{0x00, 0xff, 0x1f, 0x8b, 'b', 'i', 'n'},
		{},
	}
	for i, ud := range userData {
		img, err := BuildISO(Seed{InstanceID: "px-abc", Hostname: "px-abc", UserData: ud, VendorData: []byte("#cloud-config\npackages: [htop]\n"), InstallGuestAgent: true})
		if err != nil {
			t.Fatalf("case %d: BuildISO: %v", i, err)
		}
		label, files := readISO(t, img)
		if label != VolumeID {
			t.Errorf("case %d: label = %q, want %q", i, label, VolumeID)
		}
		if len(files) != 3 {
			t.Errorf("case %d: files = %v, want meta-data, user-data, vendor-data", i, keys(files))
		}
		if got := files[FileUserData]; !bytes.Equal(got, ud) {
			t.Errorf("case %d: user-data = %q, want %q", i, got, ud)
		}
		if got, want := files[FileMetaData], MetaData("px-abc", "px-abc"); !bytes.Equal(got, want) {
			t.Errorf("case %d: meta-data = %q, want %q", i, got, want)
		}
		want, _ := VendorData(true, []byte("#cloud-config\npackages: [htop]\n"))
		if got := files[FileVendorData]; !bytes.Equal(got, want) {
			t.Errorf("case %d: vendor-data differs:\n%s\nwant\n%s", i, got, want)
		}
	}
}

func TestBuildISORequiresInstanceID(t *testing.T) {
	if _, err := BuildISO(Seed{}); err == nil {
		t.Fatal("BuildISO without instance id: got nil error")
	}
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestMetaData(t *testing.T) {
	var got map[string]string
	if err := yaml.Unmarshal(MetaData("px-1", "host: evil\nx"), &got); err != nil {
		t.Fatalf("meta-data is not YAML: %v", err)
	}
	if got["instance-id"] != "px-1" || got["local-hostname"] != "host: evil\nx" || len(got) != 2 {
		t.Errorf("meta-data = %v", got)
	}
}

type part struct{ ctype, body string }

func parseMIME(t *testing.T, doc []byte) []part {
	t.Helper()
	head, body, ok := bytes.Cut(doc, []byte("\n\n"))
	if !ok {
		t.Fatalf("no header/body separator in %q", doc)
	}
	var ctype string
	for _, l := range strings.Split(string(head), "\n") {
		if k, v, ok := strings.Cut(l, ": "); ok && strings.EqualFold(k, "Content-Type") {
			ctype = v
		}
	}
	mt, params, err := mime.ParseMediaType(ctype)
	if err != nil || mt != "multipart/mixed" {
		t.Fatalf("content type %q: %v", ctype, err)
	}
	r := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	var parts []part
	for {
		p, err := r.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("next part: %v", err)
		}
		b, _ := io.ReadAll(p)
		pt, _, _ := mime.ParseMediaType(p.Header.Get("Content-Type"))
		parts = append(parts, part{pt, string(b)})
	}
	return parts
}

func TestVendorData(t *testing.T) {
	user := "#cloud-config\nruncmd: [[touch, /x]]\n"
	tests := []struct {
		name  string
		agent bool
		user  string
		want  []string // content types in order
	}{
		{"agent only", true, "", []string{"text/x-shellscript"}},
		{"agent and user", true, user, []string{"text/x-shellscript", "text/plain"}},
		{"user only", false, user, []string{"text/plain"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			doc, err := VendorData(tc.agent, []byte(tc.user))
			if err != nil {
				t.Fatal(err)
			}
			parts := parseMIME(t, doc)
			if len(parts) != len(tc.want) {
				t.Fatalf("parts = %d, want %d", len(parts), len(tc.want))
			}
			for i, p := range parts {
				if p.ctype != tc.want[i] {
					t.Errorf("part %d type = %q, want %q", i, p.ctype, tc.want[i])
				}
				switch p.ctype {
				case "text/x-shellscript":
					if !strings.HasPrefix(p.body, "#!/bin/sh") || !strings.Contains(p.body, "qemu-guest-agent") {
						t.Errorf("script part = %q", p.body)
					}
				case "text/plain":
					if p.body != tc.user {
						t.Errorf("user part = %q, want %q", p.body, tc.user)
					}
				}
			}
		})
	}
	if doc, err := VendorData(false, nil); err != nil || len(doc) != 0 {
		t.Errorf("VendorData(false, nil) = %q, %v; want empty", doc, err)
	}
}

func TestDefaultSquidUserDataRefusesUnhashablePassword(t *testing.T) {
	long := strings.Repeat("p", htpasswd.MaxPasswordBytes+1)
	doc, err := DefaultSquidUserData(8080, &events.ProxyAuth{Username: "crawler", Password: long}, egress.Policy{})
	if err == nil || !strings.Contains(err.Error(), "at most 72") || strings.Contains(err.Error(), long) || doc != nil {
		t.Fatalf("DefaultSquidUserData with a 73-byte password = %d bytes, %v; want a clear error", len(doc), err)
	}
}

func TestDefaultSquidUserData(t *testing.T) {
	tests := []struct {
		name string
		auth *events.ProxyAuth
	}{
		{"open", nil},
		{"auth", &events.ProxyAuth{Username: "crawler", Password: `p'a"s s\n`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pol := egress.Policy{AllowEndpoints: []netip.AddrPort{netip.MustParseAddrPort("203.0.114.9:8480")}}
			doc, err := DefaultSquidUserData(8080, tc.auth, pol)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(doc, []byte("#cloud-config\n")) {
				t.Fatalf("not a cloud-config: %q", doc[:20])
			}
			var cc struct {
				Packages   []string `yaml:"packages"`
				WriteFiles []struct {
					Path    string `yaml:"path"`
					Content string `yaml:"content"`
				} `yaml:"write_files"`
				Runcmd [][]string `yaml:"runcmd"`
			}
			if err := yaml.Unmarshal(doc, &cc); err != nil {
				t.Fatalf("not YAML: %v\n%s", err, doc)
			}
			files := map[string]string{}
			for _, f := range cc.WriteFiles {
				files[f.Path] = f.Content
			}
			conf := files["/etc/proxyfleet/squid.conf"]
			if !strings.Contains(conf, "http_port 8080\n") {
				t.Errorf("squid.conf lacks http_port 8080:\n%s", conf)
			}
			// The egress denies come before any allow, so they hold for
			// authenticated clients too.
			rules := pol.SquidRules(egress.SquidOwn{File: OwnAddressesFile})
			at, allow := strings.Index(conf, rules), strings.Index(conf, "http_access allow")
			if at < 0 || allow < at {
				t.Errorf("squid.conf lacks the egress rules before its first http_access allow:\n%s", conf)
			}
			// The own-address list: written before Squid starts, then kept
			// current by a unit that runs the same script every few seconds.
			setup := files["/etc/proxyfleet/setup-squid.sh"]
			if files[OwnAddressesScriptPath] != OwnAddressesScript {
				t.Errorf("%s is not the own-address script:\n%s", OwnAddressesScriptPath, files[OwnAddressesScriptPath])
			}
			refresh, restart, enable := strings.Index(setup, "sh "+OwnAddressesScriptPath+"\n"), strings.Index(setup, "systemctl restart squid\n"), strings.Index(setup, "systemctl enable --now "+OwnAddressesUnit+"\n")
			if refresh < 0 || restart < refresh || enable < restart {
				t.Errorf("the setup script must list the own addresses, start squid, then enable %s:\n%s", OwnAddressesUnit, setup)
			}
			unit := files["/etc/systemd/system/"+OwnAddressesUnit]
			if want := fmt.Sprintf("ExecStart=/bin/sh -c 'while :; do /bin/sh %s || echo \"own addresses not refreshed\"; sleep %d; done'\n", OwnAddressesScriptPath, OwnAddressesEvery); !strings.Contains(unit, want) || !strings.Contains(unit, "Restart=always\n") {
				t.Errorf("%s does not rerun the script:\n%s", OwnAddressesUnit, unit)
			}
			// The client stays hidden: no header naming it is forwarded.
			for _, want := range []string{egress.SquidHideClient(), "request_header_access Forwarded deny all\n"} {
				if !strings.Contains(conf, want) {
					t.Errorf("squid.conf lacks %q:\n%s", want, conf)
				}
			}
			if !strings.Contains(conf, "acl proxyfleet_egress_own_address dst \""+OwnAddressesFile+"\"\n") {
				t.Errorf("squid.conf does not read %s:\n%s", OwnAddressesFile, conf)
			}
			if len(cc.Packages) == 0 || cc.Packages[0] != "squid" {
				t.Errorf("packages = %v, want squid first", cc.Packages)
			}
			if len(cc.Runcmd) != 1 {
				t.Errorf("runcmd = %v", cc.Runcmd)
			}
			hasAuth := strings.Contains(conf, "proxy_auth REQUIRED")
			if hasAuth != (tc.auth != nil) {
				t.Errorf("auth in squid.conf = %v, want %v", hasAuth, tc.auth != nil)
			}
			if tc.auth != nil {
				if bytes.Contains(doc, []byte("s s")) {
					t.Errorf("the user-data holds the password in the clear:\n%s", doc)
				}
				if got := files["/etc/proxyfleet/htpasswd"]; !htpasswd.Verify([]byte(got), tc.auth.Username, tc.auth.Password) {
					t.Errorf("htpasswd file %q does not verify the pool's password", got)
				}
				if !strings.Contains(conf, "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/proxyfleet.htpasswd\n") ||
					!strings.Contains(files["/etc/proxyfleet/setup-squid.sh"], "install -m 0640 -o root -g proxy /etc/proxyfleet/htpasswd /etc/squid/proxyfleet.htpasswd\n") {
					t.Errorf("setup script does not install the htpasswd file where squid.conf reads it:\n%s", files["/etc/proxyfleet/setup-squid.sh"])
				}
			} else if !strings.Contains(conf, "http_access allow all") {
				t.Errorf("open proxy lacks http_access allow all:\n%s", conf)
			}
		})
	}
}

// TestBuildISOIsAFunctionOfTheSeed renders one seed twice, 20 ms apart
// (the volume dates have hundredths of a second), and wants the same bytes
// and volume dates that say "not specified".
func TestBuildISOIsAFunctionOfTheSeed(t *testing.T) {
	s := Seed{InstanceID: "px-abc", Hostname: "px-abc", UserData: []byte("#cloud-config\n"), InstallGuestAgent: true}
	a, err := BuildISO(s)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	b, err := BuildISO(s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("two renders of one seed differ")
	}
	dates := a[pvdOffset+pvdDatesFrom : pvdOffset+pvdDatesTo]
	if want := bytes.Repeat(unspecifiedDate, 4); !bytes.Equal(dates, want) {
		t.Fatalf("volume dates %q, want %q", dates, want)
	}
	if label, _ := readISO(t, a); label != VolumeID {
		t.Fatalf("label %q after clearing the dates", label)
	}
}
