package events

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"time"

	"proxyfleet/pkg/egress"
)

// Pool defaults applied by [PoolSpec.Normalize], and limits checked by
// [PoolSpec.Validate].
const (
	DefaultProxyPort = 3128
	// MaxPoolSize is the largest size a pool may ask for.
	MaxPoolSize = 100_000
	// DefaultUnhealthyAfter is how long a proxy may stay unhealthy before it
	// is replaced, when the pool does not say.
	DefaultUnhealthyAfter = 2 * time.Minute
	// MinUnhealthyAfter is the shortest unhealthyAfter a pool may ask for:
	// shorter would replace proxies for one slow probe round.
	MinUnhealthyAfter = 10 * time.Second
	// MaxPasswordBytes is the longest proxy password: Squid-based proxies
	// store it as a bcrypt hash (pkg/htpasswd), which takes at most 72 bytes.
	MaxPasswordBytes = 72
	// MaxTargets bounds a pool's targets.
	MaxTargets = 1000
	// MaxUsernameBytes bounds a proxy username (it travels in events).
	MaxUsernameBytes = 255
	// MaxUserDataBytes bounds a pool's cloud-init user-data.
	MaxUserDataBytes = 64 << 10
)

// PoolSpec is what an operator asks for: a named group of proxies. It is the
// body of fleet.api.pool.apply. UserData and Auth.Password are secrets: they
// never appear in events or logs (see [PoolSpec.Public]). pool.apply
// requires Size to be present and not null: its zero value empties a pool.
type PoolSpec struct {
	Name     string     `json:"name"`
	Provider string     `json:"provider"`
	Targets  []string   `json:"targets,omitempty"`
	Size     int        `json:"size"`
	Image    string     `json:"image,omitempty"`
	Profile  string     `json:"profile,omitempty"`
	Port     int        `json:"port,omitempty"`
	Auth     *ProxyAuth `json:"auth,omitempty"`
	UserData string     `json:"userData,omitempty"`
	MaxAge   Duration   `json:"maxAge,omitempty"`
	// UnhealthyAfter is how long a proxy may stay unhealthy before it is
	// replaced (default [DefaultUnhealthyAfter], at least
	// [MinUnhealthyAfter]).
	UnhealthyAfter Duration `json:"unhealthyAfter,omitempty"`
	// DistinctEgress, when true, means no two members of the pool may
	// share an egress address (the address health's echo endpoint sees
	// through a proxy): of two ready members that share one, the planner
	// keeps the older and replaces the newer, one at a time.
	DistinctEgress bool `json:"distinctEgress,omitempty"`
	// Egress widens the pool's egress policy beyond the default (see
	// package egress): more destination ranges, more ports.
	Egress *Egress `json:"egress,omitempty"`
	// Gateway steers how the gateway routes the pool's traffic (nil: the
	// defaults).
	Gateway *GatewaySpec `json:"gateway,omitempty"`
	// Autoscale, when set, has the planner size the pool by the demand
	// the gateways report, between its min and max. Size stays required:
	// it is the starting size (clamped into [min, max]); see
	// [PoolSpec.SizeAfterApply] for what a re-apply keeps.
	Autoscale *Autoscale `json:"autoscale,omitempty"`
	// Placement steers new proxies by their targets' labels: required
	// label values and a weighted spread (nil: any target of the entry).
	Placement *Placement `json:"placement,omitempty"`
	// External lists the proxies of a pool whose provider is
	// [ProviderExternal]: upstream proxies proxyfleet routes and probes
	// but never creates. Their credentials are secrets.
	External *External `json:"external,omitempty"`
}

// Egress is what a pool's proxies may reach beyond the default egress
// policy, which refuses loopback, link-local, private, unique-local,
// multicast and the host's own addresses, and ports other than 443 (80 and
// 443 for plain HTTP).
type Egress struct {
	// AllowCIDRs are destination ranges (or single addresses) allowed
	// despite the refused ranges ("10.1.0.0/16").
	AllowCIDRs []string `json:"allowCIDRs,omitempty"`
	// AllowPorts are ports allowed for CONNECT and plain HTTP.
	AllowPorts []int `json:"allowPorts,omitempty"`
}

// MaxEgressAllows bounds each list of an [Egress].
const MaxEgressAllows = 64

// validate checks e; fields are named under prefix ("egress"). An allowed
// range that holds the host itself (loopback, unspecified: see
// [egress.CheckAllowCIDR]) is refused unless recorded: a spec recorded
// before that check still reads, and its proxies still refuse the host,
// whatever the range holds.
func (e *Egress) validate(v *ValidationError, prefix string, recorded bool) {
	if len(e.AllowCIDRs) > MaxEgressAllows {
		v.Add(prefix+".allowCIDRs", fmt.Sprintf("may hold at most %d ranges", MaxEgressAllows), fmt.Sprint(len(e.AllowCIDRs)))
	}
	for i, c := range e.AllowCIDRs {
		pr, err := egress.ParseCIDR(c)
		if err == nil && !recorded {
			err = egress.CheckAllowCIDR(pr)
		}
		if err != nil {
			v.Add(fmt.Sprintf("%s.allowCIDRs[%d]", prefix, i), err.Error(), c)
		}
	}
	if len(e.AllowPorts) > MaxEgressAllows {
		v.Add(prefix+".allowPorts", fmt.Sprintf("may hold at most %d ports", MaxEgressAllows), fmt.Sprint(len(e.AllowPorts)))
	}
	for i, n := range e.AllowPorts {
		if _, err := egress.ParsePort(n); err != nil {
			v.Add(fmt.Sprintf("%s.allowPorts[%d]", prefix, i), err.Error(), fmt.Sprint(n))
		}
	}
}

// Clone returns a deep copy of e (nil for nil).
func (e *Egress) Clone() *Egress {
	if e == nil {
		return nil
	}
	return &Egress{AllowCIDRs: append([]string(nil), e.AllowCIDRs...), AllowPorts: append([]int(nil), e.AllowPorts...)}
}

// Policy compiles e (nil: the default) and the agent's allowed endpoints
// into the policy a proxy enforces.
func (e *Egress) Policy(endpoints []netip.AddrPort) (egress.Policy, error) {
	if e == nil {
		return egress.Compile(nil, nil, endpoints)
	}
	return egress.Compile(e.AllowCIDRs, e.AllowPorts, endpoints)
}

// ProxyAuth is the basic-auth pair a proxy demands from its clients.
type ProxyAuth struct {
	Username string `json:"username"`
	Password string `json:"password,omitempty"`
}

// Duration is a time.Duration written as a Go duration string ("72h").
type Duration time.Duration

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	if d == 0 {
		return []byte(`""`), nil
	}
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON accepts a duration string such as "90m" or "72h".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("must be a duration string such as \"72h\"")
	}
	if s == "" {
		*d = 0
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("must be a duration string such as \"72h\": %q", s)
	}
	*d = Duration(v)
	return nil
}

// Normalize fills defaults in place.
func (p *PoolSpec) Normalize() {
	if p.Port == 0 {
		p.Port = DefaultProxyPort
	}
	if p.UnhealthyAfter == 0 {
		p.UnhealthyAfter = Duration(DefaultUnhealthyAfter)
	}
	if p.Egress != nil && len(p.Egress.AllowCIDRs) == 0 && len(p.Egress.AllowPorts) == 0 {
		p.Egress = nil // the default policy: the same spec as none
	}
	if p.Provider == ProviderExternal && p.External != nil && len(p.External.Proxies) > 0 && p.Size == 0 {
		p.Size = len(p.External.Proxies) // an external pool is its list
	}
}

// UnhealthyAfterOrDefault returns the pool's unhealthyAfter, or the default
// for a spec recorded before the field existed.
func (p PoolSpec) UnhealthyAfterOrDefault() time.Duration {
	if p.UnhealthyAfter <= 0 {
		return DefaultUnhealthyAfter
	}
	return time.Duration(p.UnhealthyAfter)
}

// Validate checks every field and returns a [*ValidationError] listing all
// problems, or nil.
func (p *PoolSpec) Validate() error { return p.validate(false) }

// validate is [PoolSpec.Validate]; recorded relaxes what a spec already in
// the log may hold (see [Egress.validate]).
func (p *PoolSpec) validate(recorded bool) error {
	var v ValidationError
	v.AddField(CheckIdentifier("name", p.Name))
	v.AddField(CheckIdentifier("provider", p.Provider))
	if len(p.Targets) > MaxTargets {
		v.Add("targets", fmt.Sprintf("may hold at most %d targets", MaxTargets), fmt.Sprint(len(p.Targets)))
	}
	for i, t := range p.Targets {
		v.AddField(CheckIdentifier(fmt.Sprintf("targets[%d]", i), t))
	}
	if p.Size < 0 {
		v.Add("size", "must be zero or more", fmt.Sprint(p.Size))
	} else if p.Size > MaxPoolSize {
		v.Add("size", fmt.Sprintf("must be at most %d", MaxPoolSize), fmt.Sprint(p.Size))
	}
	if p.Image != "" {
		v.AddField(CheckIdentifier("image", p.Image))
	}
	if p.Profile != "" {
		v.AddField(CheckIdentifier("profile", p.Profile))
	}
	if p.Port < 0 || p.Port > 65535 {
		v.Add("port", "must be between 1 and 65535", fmt.Sprint(p.Port))
	}
	if p.Auth != nil {
		if p.Auth.Username == "" || containsAny(p.Auth.Username, ":\r\n") {
			v.Add("auth.username", "is required and may not contain ':' or line breaks", "")
		} else if len(p.Auth.Username) > MaxUsernameBytes {
			v.Add("auth.username", fmt.Sprintf("may be at most %d bytes long", MaxUsernameBytes), fmt.Sprintf("%d bytes", len(p.Auth.Username)))
		}
		if p.Auth.Password == "" || containsAny(p.Auth.Password, "\r\n") {
			v.Add("auth.password", "is required and may not contain line breaks", "")
		} else if len(p.Auth.Password) > MaxPasswordBytes {
			v.Add("auth.password", fmt.Sprintf("may be at most %d bytes long (bcrypt)", MaxPasswordBytes), fmt.Sprintf("%d bytes", len(p.Auth.Password)))
		}
	}
	if p.MaxAge < 0 {
		v.Add("maxAge", "must not be negative", time.Duration(p.MaxAge).String())
	} else if p.MaxAge > 0 && time.Duration(p.MaxAge) < time.Minute {
		v.Add("maxAge", "must be at least 1m", time.Duration(p.MaxAge).String())
	}
	if p.UnhealthyAfter < 0 {
		v.Add("unhealthyAfter", "must not be negative", time.Duration(p.UnhealthyAfter).String())
	} else if p.UnhealthyAfter > 0 && time.Duration(p.UnhealthyAfter) < MinUnhealthyAfter {
		v.Add("unhealthyAfter", "must be at least "+MinUnhealthyAfter.String(), time.Duration(p.UnhealthyAfter).String())
	}
	if p.Egress != nil {
		p.Egress.validate(&v, "egress", recorded)
	}
	if p.Gateway != nil {
		p.Gateway.validate(&v, "gateway", p.Name)
	}
	if p.Autoscale != nil {
		p.Autoscale.Validate(&v, "autoscale")
	}
	if p.Placement != nil {
		p.Placement.validate(&v, "placement", p.Provider)
	}
	p.validateExternal(&v, recorded)
	if len(p.UserData) > MaxUserDataBytes {
		v.Add("userData", "must be at most 64 KiB", fmt.Sprintf("%d bytes", len(p.UserData)))
	}
	return v.Err()
}

func containsAny(s, chars string) bool {
	for i := 0; i < len(s); i++ {
		for j := 0; j < len(chars); j++ {
			if s[i] == chars[j] {
				return true
			}
		}
	}
	return false
}

// SizeAfterApply is the number of proxies a pool wants once spec is
// applied over prev, the spec the pool had (nil for a pool that is new or
// was deleted), when the pool wanted cur proxies. Without autoscale it is
// spec.Size. With autoscale it is cur when prev was autoscaled too (a
// re-apply keeps the size autoscaling reached), else spec.Size, the
// starting size; either clamped into [min, max]. So turning autoscale off
// returns the pool to its size, and turning it on starts from there.
// Both the planner and the health projection fold pool.applied with it.
func (p PoolSpec) SizeAfterApply(prev *PoolSpec, cur int) int {
	if p.Autoscale == nil {
		return p.Size
	}
	if prev != nil && prev.Autoscale != nil {
		return p.Autoscale.Clamp(cur)
	}
	return p.Autoscale.Clamp(p.Size)
}

// SizeAfterScaled is the number of proxies a pool with spec wants after a
// pool.scaled event to size: size clamped into the autoscale bounds, or
// spec.Size for a pool without autoscale (a scaled event the planner
// could not have appended after the pool's last apply changes nothing).
func (p PoolSpec) SizeAfterScaled(size int) int {
	if p.Autoscale == nil {
		return p.Size
	}
	return p.Autoscale.Clamp(size)
}

// Public returns a copy of p without secrets, safe for events and logs.
func (p PoolSpec) Public() PoolSpec {
	out := p
	out.Targets = append([]string(nil), p.Targets...)
	out.UserData = ""
	out.Egress = p.Egress.Clone()
	out.Gateway = p.Gateway.Clone()
	out.Autoscale = p.Autoscale.Clone()
	out.Placement = p.Placement.Clone()
	out.External = p.External.public()
	if p.Auth != nil {
		out.Auth = &ProxyAuth{Username: p.Auth.Username}
	}
	return out
}

// Secrets returns the secret half of p, stored beside the event log (never in
// it) so the planner can put it into commands.
func (p PoolSpec) Secrets() PoolSecrets {
	s := PoolSecrets{UserData: p.UserData, External: p.External.secrets()}
	if p.Auth != nil {
		s.Password = p.Auth.Password
	}
	return s
}

// PoolSecrets is the part of a [PoolSpec] that may not enter the event log.
type PoolSecrets struct {
	Revision int    `json:"revision"`
	UserData string `json:"userData,omitempty"`
	Password string `json:"password,omitempty"`
	// External holds the credentials of an external pool's proxies, by
	// address ("host:port").
	External map[string]ProxyAuth `json:"external,omitempty"`
}

// Empty reports whether there are no secrets at all.
func (s PoolSecrets) Empty() bool {
	return s.UserData == "" && s.Password == "" && len(s.External) == 0
}

// DigestKeyLen is the length of the key of [PoolSecrets.Digest].
const DigestKeyLen = 32

// Digest returns an HMAC-SHA256 of the secrets under key, recorded in
// events so a change of user-data or password is a new spec revision
// without the values ever entering the log. The key (in fleet-secrets)
// keeps readers of the log from testing guessed passwords against it.
func (s PoolSecrets) Digest(key []byte) string {
	if s.Empty() {
		return ""
	}
	h := hmac.New(sha256.New, key)
	s.write(h)
	return hex.EncodeToString(h.Sum(nil))
}

// LegacyDigest is the unkeyed SHA-256 that planners before keyed digests
// recorded. It is only compared with digests already in the log, never
// written again.
func (s PoolSecrets) LegacyDigest() string {
	if s.Empty() {
		return ""
	}
	h := sha256.New()
	s.write(h)
	return hex.EncodeToString(h.Sum(nil))
}

// Matches reports whether digest, from an event, is the digest of s: under
// key, or the legacy unkeyed one.
func (s PoolSecrets) Matches(key []byte, digest string) bool {
	if s.Empty() || digest == "" {
		return s.Empty() && digest == ""
	}
	return hmac.Equal([]byte(s.Digest(key)), []byte(digest)) || hmac.Equal([]byte(s.LegacyDigest()), []byte(digest))
}

func (s PoolSecrets) write(w io.Writer) {
	fmt.Fprintf(w, "%d:%s\x00%d:%s", len(s.UserData), s.UserData, len(s.Password), s.Password)
	// External credentials extend the digest only when present, so the
	// digests recorded before they existed still match.
	for _, addr := range slices.Sorted(maps.Keys(s.External)) {
		a := s.External[addr]
		fmt.Fprintf(w, "\x00%d:%s\x00%d:%s\x00%d:%s", len(addr), addr, len(a.Username), a.Username, len(a.Password), a.Password)
	}
}
