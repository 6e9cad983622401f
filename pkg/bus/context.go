package bus

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nats-io/nats.go"
)

// natsContext is the part of a nats CLI context file (the JSON written by
// `nats context save`) that services honour.
type natsContext struct {
	URL      string `json:"url"`
	User     string `json:"user"`
	Password string `json:"password"`
	Token    string `json:"token"`
	Creds    string `json:"creds"`
	NKey     string `json:"nkey"`
	Cert     string `json:"cert"`
	Key      string `json:"key"`
	CA       string `json:"ca"`
	// InboxPrefix is the prefix of reply subjects (deploy/nats gives each
	// identity its own).
	InboxPrefix string `json:"inbox_prefix"`

	// Settings a service cannot honour; a context using them is refused
	// rather than silently half-applied.
	SocksProxy string `json:"socks_proxy"`
	UserJWT    string `json:"user_jwt"`
	NSC        string `json:"nsc"`
	JSDomain   string `json:"jetstream_domain"`
	JSAPI      string `json:"jetstream_api_prefix"`
	TLSFirst   bool   `json:"tls_first"`
}

// contextPath resolves a context name the way the nats CLI does:
// $XDG_CONFIG_HOME/nats/context/<name>.json, else ~/.config/nats/context.
// A value with a path separator or a .json suffix is a file path.
func contextPath(name string) (string, error) {
	if strings.ContainsRune(name, os.PathSeparator) || strings.HasSuffix(name, ".json") {
		return name, nil
	}
	dir := os.Getenv("XDG_CONFIG_HOME")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("nats context %q: no $XDG_CONFIG_HOME and no home directory: %w", name, err)
		}
		dir = filepath.Join(home, ".config")
	}
	return filepath.Join(dir, "nats", "context", name+".json"), nil
}

// contextOptions reads the nats CLI context name and returns its server URL
// and connection options.
func contextOptions(name string) (string, []nats.Option, [][]byte, error) {
	path, err := contextPath(name)
	if err != nil {
		return "", nil, nil, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", nil, nil, fmt.Errorf("nats context %q: %w (create it with `nats context save`)", name, err)
	}
	var c natsContext
	if err := json.Unmarshal(b, &c); err != nil {
		return "", nil, nil, fmt.Errorf("nats context %q (%s) is not valid JSON: %w", name, path, err)
	}
	var unsupported []string
	for field, set := range map[string]bool{
		"socks_proxy": c.SocksProxy != "", "user_jwt": c.UserJWT != "", "nsc": c.NSC != "",
		"jetstream_domain": c.JSDomain != "", "jetstream_api_prefix": c.JSAPI != "", "tls_first": c.TLSFirst,
	} {
		if set {
			unsupported = append(unsupported, field)
		}
	}
	if len(unsupported) > 0 {
		return "", nil, nil, fmt.Errorf("nats context %q (%s) sets %s, which proxyfleet services do not support; use url, user/password, token, creds, nkey and TLS files",
			name, path, strings.Join(unsupported, ", "))
	}
	if c.URL == "" {
		return "", nil, nil, errors.New("nats context " + name + " (" + path + ") has no url")
	}
	var opts []nats.Option
	var secrets [][]byte
	switch {
	case c.Creds != "":
		opts = append(opts, nats.UserCredentials(c.Creds))
		secrets = fileSecret(secrets, c.Creds)
	case c.NKey != "":
		o, err := nats.NkeyOptionFromSeed(c.NKey)
		if err != nil {
			return "", nil, nil, fmt.Errorf("nats context %q: nkey %s: %w", name, c.NKey, err)
		}
		opts = append(opts, o)
		secrets = fileSecret(secrets, c.NKey)
	case c.Token != "":
		opts = append(opts, nats.Token(c.Token))
		secrets = append(secrets, []byte(c.Token))
	case c.User != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
		secrets = append(secrets, []byte(c.User+"\x00"+c.Password))
	}
	if c.Cert != "" || c.Key != "" {
		opts = append(opts, nats.ClientCert(c.Cert, c.Key))
		secrets = fileSecret(secrets, c.Key)
	}
	if c.CA != "" {
		opts = append(opts, nats.RootCAs(c.CA))
	}
	if c.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(c.InboxPrefix))
	}
	return c.URL, opts, secrets, nil
}
