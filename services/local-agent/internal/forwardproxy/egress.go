package forwardproxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"proxyfleet/pkg/egress"
)

// refusal is a destination the egress policy refuses.
type refusal struct {
	rule egress.Rule
	dest string // what the client asked for, host:port
	addr netip.Addr
}

func (r *refusal) Error() string {
	return fmt.Sprintf("egress to %s (%s) denied: %s", r.dest, r.addr, r.rule)
}

// refuse answers a refused request at once: 403 naming the rule in the
// [egress.Header] header and the body.
func (p *Proxy) refuse(w http.ResponseWriter, r *http.Request, re *refusal) {
	p.cfg.Log.Warn("egress denied", "method", r.Method, "host", re.dest, "addr", re.addr.String(), "rule", string(re.rule))
	w.Header().Set(egress.Header, "denied "+string(re.rule))
	w.Header().Set("Connection", "close")
	http.Error(w, fmt.Sprintf("proxyfleet egress: denied %s: %s is not an allowed destination", re.rule, re.dest), http.StatusForbidden)
}

// dialHTTP is the forwarding transport's dialer: plain HTTP rules.
func (p *Proxy) dialHTTP(ctx context.Context, _, address string) (net.Conn, error) {
	return p.dialChecked(ctx, address, false)
}

// dialChecked checks hostport's port, then resolves its host once, checks
// every address against the policy (one refused address refuses the
// request: a name that resolves to a private address among public ones is
// not a destination), and dials only the checked addresses, as literals,
// so no second resolution can swap them.
func (p *Proxy) dialChecked(ctx context.Context, hostport string, connect bool) (net.Conn, error) {
	host, portStr, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return nil, &refusal{rule: egress.RulePort, dest: hostport}
	}
	pol := p.cfg.Egress
	// A port no destination may be reached on is refused before the
	// name is looked up: no DNS query leaves for it.
	if rule := pol.PortRule(uint16(port), connect); rule != egress.RuleOK {
		return nil, &refusal{rule: rule, dest: hostport}
	}
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		addrs, err = p.cfg.Resolve(ctx, host)
		if err != nil {
			return nil, err
		}
		if len(addrs) == 0 {
			return nil, fmt.Errorf("%s: no addresses", host)
		}
	}
	pol.Own = p.own.get()
	for _, a := range addrs {
		if rule := pol.Check(a, uint16(port), connect); rule != egress.RuleOK {
			return nil, &refusal{rule: rule, dest: hostport, addr: a.Unmap()}
		}
	}
	var errs []error
	for _, a := range addrs {
		c, err := p.cfg.Dial(ctx, "tcp", netip.AddrPortFrom(a.Unmap(), uint16(port)).String())
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}

// ownCache holds the host's own addresses, re-read at most every
// [OwnAddrsRefresh]; a failed read keeps the last list.
type ownCache struct {
	read  func() ([]netip.Addr, error)
	mu    sync.Mutex
	addrs []netip.Addr
	at    time.Time
}

func (o *ownCache) get() []netip.Addr {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.at.IsZero() || time.Since(o.at) > OwnAddrsRefresh {
		if addrs, err := o.read(); err == nil {
			o.addrs = addrs
		}
		o.at = time.Now()
	}
	return o.addrs
}
