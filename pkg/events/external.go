package events

import (
	"fmt"
	"maps"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// External pools hold proxies proxyfleet does not create: upstream proxies
// an operator bought (or runs elsewhere), listed by URL. The planner
// records each as a proxy placed on the reserved entry and target
// [ProviderExternal] and speaks for it as that entry's agent would: a
// proxy is "running" once listed and "deleted" once unlisted, nothing
// ever being created or deleted. A verdict that would replace an owned
// proxy (unhealthy too long, banned) disables an external one instead
// ([ProxyDisabled]) until [External.DisableFor] has passed and a probe
// succeeds again.
const (
	// ProviderExternal is the provider of external pools, and the entry
	// and target their proxies are placed on. No agent may serve an
	// entry of that name.
	ProviderExternal = "external"
	// MaxExternalProxies bounds an external pool's members.
	MaxExternalProxies = 1000
	// DefaultDisableFor is how long a banned or failing external proxy
	// stays out of service, when the pool does not say.
	DefaultDisableFor = 10 * time.Minute
	// MinDisableFor is the shortest disableFor a pool may ask for.
	MinDisableFor = 10 * time.Second
)

// External lists an external pool's proxies: in Proxies, or in File, a
// file on the planner's host that the planner watches (one proxy per line:
// "<url> [key=value,...]"; blank lines and lines starting with '#' are
// skipped). Exactly one of them is set.
type External struct {
	Proxies []ExternalProxy `json:"proxies,omitempty"`
	File    string          `json:"file,omitempty"`
	// DisableFor is how long a member stays disabled after a verdict
	// (default [DefaultDisableFor], at least [MinDisableFor]).
	DisableFor Duration `json:"disableFor,omitempty"`
}

// ExternalProxy is one upstream proxy: URL is "http://[user:password@]host:port";
// its credentials are secrets (see [PoolSpec.Public]); Labels are its labels,
// as a target's would be (region, country, provider, …).
type ExternalProxy struct {
	URL    string            `json:"url"`
	Labels map[string]string `json:"labels,omitempty"`
}

// Upstream is a parsed [ExternalProxy] URL: Address is "host:port", the
// proxy's address in events and views; Auth its credentials (nil without).
type Upstream struct {
	Address string
	Auth    *ProxyAuth
}

// ParseUpstream parses an external proxy URL. Only "http" proxies are
// supported: the gateway and health speak plain HTTP (and CONNECT) to a
// proxy. The error says what is wrong without quoting the credentials.
func ParseUpstream(raw string) (Upstream, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return Upstream{}, fmt.Errorf("must be a URL such as http://user:password@203.0.113.7:3128 (it does not parse)")
	}
	switch {
	case u.Scheme != "http":
		return Upstream{}, fmt.Errorf("must use scheme http (an HTTP proxy), not %q", u.Scheme)
	case u.Opaque != "" || u.Host == "":
		return Upstream{}, fmt.Errorf("must be http://[user:password@]host:port")
	case (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "":
		return Upstream{}, fmt.Errorf("must not have a path, query or fragment: a proxy URL is http://[user:password@]host:port")
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || host == "" {
		return Upstream{}, fmt.Errorf("must name host and port (http://host:port)")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return Upstream{}, fmt.Errorf("must have a port between 1 and 65535")
	}
	out := Upstream{Address: net.JoinHostPort(strings.ToLower(host), port)}
	if u.User != nil {
		pw, _ := u.User.Password()
		user := u.User.Username()
		switch {
		case user == "" || containsAny(user, ":\r\n"):
			return Upstream{}, fmt.Errorf("has credentials without a username, or one with ':' or line breaks")
		case len(user) > MaxUsernameBytes:
			return Upstream{}, fmt.Errorf("has a username longer than %d bytes", MaxUsernameBytes)
		case containsAny(pw, "\r\n") || len(pw) > 1024:
			return Upstream{}, fmt.Errorf("has a password with line breaks or longer than 1024 bytes")
		}
		out.Auth = &ProxyAuth{Username: user, Password: pw}
	}
	return out, nil
}

// PublicURL is raw without its credentials ("http://host:port"), or ""
// when raw does not parse.
func PublicURL(raw string) string {
	up, err := ParseUpstream(raw)
	if err != nil {
		return ""
	}
	return "http://" + up.Address
}

// DisableForOrDefault is the pool's disableFor, or the default.
func (x *External) DisableForOrDefault() time.Duration {
	if x == nil || x.DisableFor <= 0 {
		return DefaultDisableFor
	}
	return time.Duration(x.DisableFor)
}

// Clone returns a copy of x that shares nothing with it.
func (x *External) Clone() *External {
	if x == nil {
		return nil
	}
	out := &External{File: x.File, DisableFor: x.DisableFor}
	for _, p := range x.Proxies {
		out.Proxies = append(out.Proxies, ExternalProxy{URL: p.URL, Labels: maps.Clone(p.Labels)})
	}
	return out
}

// public is x with every URL stripped of its credentials.
func (x *External) public() *External {
	out := x.Clone()
	if out == nil {
		return nil
	}
	for i := range out.Proxies {
		out.Proxies[i].URL = PublicURL(out.Proxies[i].URL)
	}
	return out
}

// secrets returns the credentials of x's proxies by address, or nil.
func (x *External) secrets() map[string]ProxyAuth {
	if x == nil {
		return nil
	}
	var out map[string]ProxyAuth
	for _, p := range x.Proxies {
		up, err := ParseUpstream(p.URL)
		if err != nil || up.Auth == nil {
			continue
		}
		if out == nil {
			out = map[string]ProxyAuth{}
		}
		out[up.Address] = *up.Auth
	}
	return out
}

// validate adds x's problems to v, each named under prefix
// ("external.proxies[1].url"). Messages never quote a URL's credentials.
// A recorded spec may hold both a file and proxies: the planner records
// the proxies it read from the file with it.
func (x *External) validate(v *ValidationError, prefix string, recorded bool) {
	switch {
	case len(x.Proxies) == 0 && x.File == "":
		v.Add(prefix, "must list proxies or name a file of them", "")
	case len(x.Proxies) > 0 && x.File != "" && !recorded:
		v.Add(prefix+".file", "may not be given with proxies: list them in one place", x.File)
	}
	if x.File != "" && (!strings.HasPrefix(x.File, "/") || containsAny(x.File, "\x00\r\n")) {
		v.Add(prefix+".file", "must be an absolute path on the planner's host", x.File)
	}
	if x.DisableFor < 0 || (x.DisableFor > 0 && time.Duration(x.DisableFor) < MinDisableFor) {
		v.Add(prefix+".disableFor", "must be at least "+MinDisableFor.String(), time.Duration(x.DisableFor).String())
	}
	if len(x.Proxies) > MaxExternalProxies {
		v.Add(prefix+".proxies", fmt.Sprintf("may list at most %d proxies", MaxExternalProxies), fmt.Sprint(len(x.Proxies)))
	}
	seen := map[string]int{}
	for i, p := range x.Proxies {
		f := fmt.Sprintf("%s.proxies[%d]", prefix, i)
		up, err := ParseUpstream(p.URL)
		if err != nil {
			v.Add(f+".url", err.Error(), PublicURL(p.URL))
		} else if j, ok := seen[up.Address]; ok {
			v.Add(f+".url", fmt.Sprintf("lists %s again (proxies[%d])", up.Address, j), "http://"+up.Address)
		} else {
			seen[up.Address] = i
		}
		CheckLabels(v, f+".labels", p.Labels)
	}
}

// ProxyDisabledData is the planner's decision to take an external proxy
// out of service until Until, and why ("banned: captcha", "unhealthy for
// 2m0s: …"). Health ends it with a ready event once Until has passed and
// a probe succeeds.
type ProxyDisabledData struct {
	Until  time.Time `json:"until"`
	Reason string    `json:"reason"`
}

// validateExternal checks that External and provider agree, and that an
// external pool asks for nothing only a created proxy has.
func (p *PoolSpec) validateExternal(v *ValidationError, recorded bool) {
	if p.Provider != ProviderExternal {
		if p.External != nil {
			v.Add("external", "is for pools whose provider is "+ProviderExternal, p.Provider)
		}
		return
	}
	if p.External == nil {
		v.Add("external", "is required for provider "+ProviderExternal+": list the proxies (external.proxies) or a file of them (external.file)", "")
		return
	}
	p.External.validate(v, "external", recorded)
	if n := len(p.External.Proxies); n > 0 && p.Size != 0 && p.Size != n {
		v.Add("size", fmt.Sprintf("of an external pool is the number of its proxies (%d): leave it 0 or give that", n), fmt.Sprint(p.Size))
	}
	created := []struct {
		field string
		set   bool
	}{
		{"targets", len(p.Targets) > 0},
		{"image", p.Image != ""},
		{"profile", p.Profile != ""},
		{"auth", p.Auth != nil},
		{"userData", p.UserData != ""},
		{"maxAge", p.MaxAge != 0},
		{"distinctEgress", p.DistinctEgress},
		{"autoscale", p.Autoscale != nil},
		{"placement", p.Placement != nil},
	}
	for _, c := range created {
		if c.set {
			v.Add(c.field, "does not apply to an external pool: proxyfleet creates none of its proxies (credentials go in each proxy's URL)", "")
		}
	}
}
