package cloudinit

import (
	"bytes"
	"errors"
	"io"
	"maps"
	"mime"
	"mime/multipart"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
)

// renderSquid is the call of the renderer the fuzz target checks.
func renderSquid(port int, auth *events.ProxyAuth) ([]byte, error) {
	return DefaultSquidUserData(port, auth, egress.Policy{})
}

// cloudConfig is the rendered document as cloud-init reads it.
type cloudConfig struct {
	top   map[string]any
	files []writeFileEntry
}

type writeFileEntry struct {
	Path        string `yaml:"path"`
	Permissions string `yaml:"permissions"`
	Owner       string `yaml:"owner"`
	Content     string `yaml:"content"`
}

func parseCloudConfig(t *testing.T, doc []byte) cloudConfig {
	t.Helper()
	if !bytes.HasPrefix(doc, []byte("#cloud-config\n")) {
		t.Fatalf("the document does not start with the #cloud-config header:\n%s", doc)
	}
	var cc cloudConfig
	if err := yaml.Unmarshal(doc, &cc.top); err != nil {
		t.Fatalf("the document is not YAML: %v\n%s", err, doc)
	}
	var files struct {
		WriteFiles []writeFileEntry `yaml:"write_files"`
	}
	if err := yaml.Unmarshal(doc, &files); err != nil {
		t.Fatalf("write_files: %v\n%s", err, doc)
	}
	cc.files = files.WriteFiles
	return cc
}

// FuzzDefaultSquidUserData: the default Squid cloud-config. Whatever the
// username and password, the document is YAML with the #cloud-config
// header and the same top-level keys, files, Squid directives and setup
// commands as with a plain username and password: no newline or quote in
// them adds a key, a file, a directive or a command. The password file
// holds one bcrypt line that verifies exactly that username and password,
// and a pair the file cannot hold is refused.
func FuzzDefaultSquidUserData(f *testing.F) {
	f.Add(3128, true, "crawler", "s3cret")
	f.Add(8080, false, "", "")
	f.Add(3128, true, "u\nruncmd: [evil]", "p\"\n  - path: /etc/evil")
	f.Add(3128, true, "a'b", "http_access allow all\nacl x src all")
	f.Add(3128, true, `"; rm -rf / #`, "#cloud-config\n---\nx: y")
	f.Add(1, true, "\u0085\u2028", "\x7f\u00a0\ufeff")
	f.Add(65535, true, "$(id)`id`\\", "\t\r\n\\\"")
	f.Fuzz(func(t *testing.T, port int, withAuth bool, username, password string) {
		if port < 1 || port > 65535 {
			port = 1 + (port%65535+65535)%65535
		}
		var auth, plain *events.ProxyAuth
		if withAuth {
			auth = &events.ProxyAuth{Username: username, Password: password}
			plain = &events.ProxyAuth{Username: "u", Password: "p"}
		}
		doc, err := renderSquid(port, auth)
		if withAuth && (htpasswd.CheckUser(username) != nil || htpasswd.CheckPassword(password) != nil) {
			// A pair Squid's password file cannot hold is refused, without
			// echoing the password (a short one may appear by chance, e.g.
			// inside the username the error names).
			if err == nil || doc != nil || (len(password) >= 6 && !strings.Contains(username, password) && strings.Contains(err.Error(), password)) {
				t.Fatalf("user %q, password %q: %d bytes, %v; want a refusal that does not echo the password", username, password, len(doc), err)
			}
			return
		}
		if err != nil {
			t.Fatalf("user %q, password %q: %v", username, password, err)
		}
		got := parseCloudConfig(t, doc)
		plainDoc, err := renderSquid(port, plain)
		if err != nil {
			t.Fatal(err)
		}
		want := parseCloudConfig(t, plainDoc)

		if k1, k2 := slices.Sorted(maps.Keys(got.top)), slices.Sorted(maps.Keys(want.top)); !slices.Equal(k1, k2) {
			t.Fatalf("top-level keys %v; want %v (user %q, password %q)", k1, k2, username, password)
		}
		for _, k := range []string{"packages", "runcmd", "package_update"} {
			if !reflect.DeepEqual(got.top[k], want.top[k]) {
				t.Fatalf("%s = %v; want %v", k, got.top[k], want.top[k])
			}
		}
		if len(got.files) != len(want.files) {
			t.Fatalf("%d files written; want %d", len(got.files), len(want.files))
		}
		for i, g := range got.files {
			w := want.files[i]
			if g.Path != w.Path || g.Permissions != w.Permissions || g.Owner != w.Owner {
				t.Fatalf("file %d is %s %s %s; want %s %s %s", i, g.Path, g.Permissions, g.Owner, w.Path, w.Permissions, w.Owner)
			}
			switch {
			case strings.HasSuffix(g.Path, "/squid.conf"):
				if g.Content != w.Content {
					t.Fatalf("squid.conf differs with user %q and password %q:\n%s\nwant\n%s", username, password, g.Content, w.Content)
				}
			case strings.HasSuffix(g.Path, "/htpasswd"):
				// One salted bcrypt line for exactly this user and password.
				if strings.Count(g.Content, "\n") > 1 || (utf8.ValidString(username+password) && !htpasswd.Verify([]byte(g.Content), username, password)) {
					t.Fatalf("the password file %q does not verify user %q with password %q", g.Content, username, password)
				}
			case strings.HasSuffix(g.Path, "/setup-squid.sh"):
				// The own-address script, a constant with expansions, is
				// compared whole below.
				gc, err1 := shellCommands(g.Content)
				wc, err2 := shellCommands(w.Content)
				if err1 != nil || err2 != nil {
					t.Fatalf("setup script does not split into commands: %v, %v\n%s", err1, err2, g.Content)
				}
				if !reflect.DeepEqual(gc, wc) {
					t.Fatalf("setup script commands with user %q:\n%q\nwant\n%q", username, gc, wc)
				}
				if len(gc) != len(wc) {
					t.Fatalf("setup script has %d commands with user %q; want %d", len(gc), username, len(wc))
				}
			default:
				if g.Content != w.Content {
					t.Fatalf("%s differs with user %q and password %q", g.Path, username, password)
				}
			}
		}
	})
}

// shellCommands splits a POSIX shell script of simple commands into their
// words: unquoted blanks separate words, unquoted newlines and ';' end a
// command, '#' at a word's start comments to the end of the line, and
// single quotes, double quotes and backslashes quote as the shell does
// (no expansion is modelled: a '$' or '`' outside single quotes is an
// error).
func shellCommands(s string) ([][]string, error) {
	var cmds [][]string
	var cmd []string
	var word strings.Builder
	inWord := false
	endWord := func() {
		if inWord {
			cmd = append(cmd, word.String())
			word.Reset()
			inWord = false
		}
	}
	endCmd := func() {
		endWord()
		if len(cmd) > 0 {
			cmds = append(cmds, cmd)
			cmd = nil
		}
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\n' || c == ';':
			endCmd()
		case c == ' ' || c == '\t':
			endWord()
		case c == '#' && !inWord:
			for i < len(s) && s[i] != '\n' {
				i++
			}
			endCmd()
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, io.ErrUnexpectedEOF
			}
			word.WriteString(s[i+1 : i+1+j])
			inWord = true
			i += j + 1
		case c == '\\':
			if i+1 < len(s) && s[i+1] != '\n' {
				word.WriteByte(s[i+1])
				inWord = true
			}
			i++
		case c == '"':
			inWord = true
			for i++; ; i++ {
				if i >= len(s) {
					return nil, io.ErrUnexpectedEOF
				}
				if s[i] == '"' {
					break
				}
				if s[i] == '$' || s[i] == '`' {
					return nil, errExpansion
				}
				if s[i] == '\\' && i+1 < len(s) && strings.IndexByte("$`\"\\\n", s[i+1]) >= 0 {
					i++
				}
				word.WriteByte(s[i])
			}
		case c == '$' || c == '`':
			return nil, errExpansion
		default:
			word.WriteByte(c)
			inWord = true
		}
	}
	endCmd()
	return cmds, nil
}

var errExpansion = errors.New("$ or ` outside single quotes: an expansion")

// FuzzMetaData: meta-data is YAML with exactly instance-id (and
// local-hostname when a hostname is given), holding the given strings.
func FuzzMetaData(f *testing.F) {
	f.Add("px-abcdefghijklmnop", "px-abcdefghijklmnop")
	f.Add("px-1", "host: evil\nx")
	f.Add("a\"\nlocal-hostname: b", "")
	f.Add("\u0085", "\x7f")
	f.Fuzz(func(t *testing.T, id, host string) {
		var got map[string]any
		if err := yaml.Unmarshal(MetaData(id, host), &got); err != nil {
			t.Fatalf("meta-data for %q, %q is not YAML: %v\n%s", id, host, err, MetaData(id, host))
		}
		want := map[string]any{"instance-id": id}
		if host != "" {
			want["local-hostname"] = host
		}
		if !utf8.ValidString(id) || !utf8.ValidString(host) {
			if len(got) != len(want) {
				t.Fatalf("meta-data keys %v; want %v", got, want)
			}
			return
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("meta-data is %q; want %q", got, want)
		}
	})
}

// FuzzVendorData: vendor-data is a MIME multipart whose parts are the
// guest-agent script (when asked for) and the operator's vendor-data byte
// for byte; vendor-data holding the boundary is refused.
func FuzzVendorData(f *testing.F) {
	f.Add(true, []byte("#cloud-config\nruncmd: [true]\n"))
	f.Add(false, []byte("#!/bin/sh\necho hi\r\n"))
	f.Add(true, []byte(""))
	f.Add(false, []byte("--"+mimeBoundary+"--\r\n"))
	f.Add(true, []byte("\r\n--"+mimeBoundary[:10]+"\r\nContent-Type: text/x-shellscript\r\n\r\nevil"))
	f.Fuzz(func(t *testing.T, install bool, user []byte) {
		doc, err := VendorData(install, user)
		if bytes.Contains(user, []byte(mimeBoundary)) {
			if err == nil {
				t.Fatalf("vendor-data holding the boundary was accepted")
			}
			return
		}
		if err != nil {
			t.Fatalf("VendorData: %v", err)
		}
		if !install && len(user) == 0 {
			if len(doc) != 0 {
				t.Fatalf("vendor-data %q; want none", doc)
			}
			return
		}
		head, body, ok := bytes.Cut(doc, []byte("\n\n"))
		if !ok {
			t.Fatalf("no header in %q", doc)
		}
		ctype, _, _ := bytes.Cut(head, []byte("\n"))
		mt, params, err := mime.ParseMediaType(strings.TrimPrefix(string(ctype), "Content-Type: "))
		if err != nil || mt != "multipart/mixed" || params["boundary"] != mimeBoundary {
			t.Fatalf("header %q: %v", head, err)
		}
		var parts [][]byte
		r := multipart.NewReader(bytes.NewReader(body), mimeBoundary)
		for {
			p, err := r.NextRawPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("part %d: %v", len(parts), err)
			}
			b, err := io.ReadAll(p)
			if err != nil {
				t.Fatalf("part %d: %v", len(parts), err)
			}
			parts = append(parts, b)
		}
		var want [][]byte
		if install {
			want = append(want, []byte(guestAgentScript))
		}
		if len(user) > 0 {
			want = append(want, user)
		}
		if !reflect.DeepEqual(parts, want) {
			t.Fatalf("parts %q; want %q", parts, want)
		}
	})
}
