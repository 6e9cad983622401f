package deploykeys

import (
	"fmt"
	"strings"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// AccountsFile is the server's accounts block, which [Generate] writes
// from the identities it made keys for: a static nats-server
// configuration has no per-user templates, so each gateway's permission
// block, naming only its own subjects, is written out in full.
// deploy/nats/accounts.conf is this file for the default identities
// ([Fixed], agent local/t1, gateway [DefaultGateway]).
const AccountsFile = "accounts.conf"

// DefaultGateway is the gateway name deploy-secrets makes a key for when
// given none; the gateway must run with --name gw-1.
const DefaultGateway = "gw-1"

// GatewayIdentity is the identity of gateway name: "gateway-<name>". The
// gateway runs with --name <name>, the seed gateway-<name>.nk and the
// inbox prefix _INBOX_gateway-<name>.
func GatewayIdentity(name string) string { return "gateway-" + name }

// GatewayInbox is the reply subject prefix of gateway name's identity.
func GatewayInbox(name string) string { return "_INBOX_" + GatewayIdentity(name) }

// Accounts renders [AccountsFile] for agents (identities
// agent-<entry>-<target>, whose permission sets permissions.conf holds) and
// gateways (names).
func Accounts(agents, gateways []string) string {
	var b strings.Builder
	b.WriteString(`# The accounts of deploy/nats, written by ` + "`make deploy-secrets`" + ` with the
# keys it names (docs/deploy.md): do not edit, generate again. One user per
# identity; the fixed identities and the agents use their permission sets
# in permissions.conf, each gateway gets its own set below, naming only its
# own demand keys, request log subject, endpoints and inbox.
include ./permissions.conf

accounts {
  FLEET {
    jetstream: enabled
    users: [
`)
	for _, id := range Fixed {
		fmt.Fprintf(&b, "      { nkey: $%s, permissions: $%s }\n", EnvName(id), permsName(id))
	}
	for _, id := range agents {
		fmt.Fprintf(&b, "      { nkey: $%s, permissions: $%s }\n", EnvName(id), permsName(id))
	}
	for _, g := range gateways {
		b.WriteString(gatewayUser(g))
	}
	b.WriteString(`    ]
  }
  SYS {}
}
`)
	return b.String()
}

// permsName is the permission set of identity in permissions.conf:
// "agent-local-t1" -> AGENT_LOCAL_T1_PERMS.
func permsName(identity string) string {
	return strings.TrimSuffix(EnvName(identity), "_NKEY") + "_PERMS"
}

// kvRead are the subjects that read and watch bucket (get, direct get,
// ordered consumers of a watch).
func kvRead(bucket string) []string {
	s := "KV_" + bucket
	return []string{
		"$JS.API.STREAM.INFO." + s,
		"$JS.API.DIRECT.GET." + s, "$JS.API.DIRECT.GET." + s + ".>", "$JS.API.STREAM.MSG.GET." + s,
		"$JS.API.CONSUMER.CREATE." + s + ".>", "$JS.API.CONSUMER.MSG.NEXT." + s + ".*",
		"$JS.API.CONSUMER.DELETE." + s + ".*", "$JS.FC." + s + ".>",
	}
}

// Buckets of the gateways' shared state (pkg/bus declares them).
const (
	// BucketGatewayCA holds the gateways' interception CA: "cert" (public)
	// and "key" (sealed). Operators may read "cert" only.
	BucketGatewayCA = bus.BucketGatewayCA
	// BucketGatewayCooldowns and BucketGatewaySessions are state every
	// gateway reads and writes.
	BucketGatewayCooldowns = bus.BucketGatewayCooldowns
	BucketGatewaySessions  = bus.BucketGatewaySessions
)

// GatewayPublish is what gateway name may publish, and GatewaySubscribe
// what it may subscribe to.
func GatewayPublish(name string) []string {
	p := []string{
		// A suspect proxy for health, a ban report for the planner (no
		// other API).
		events.SuspectSubject, events.APISubject("proxy", "report-ban"),
		"$JS.API.INFO",
	}
	p = append(p, kvRead(bus.BucketProxies)...)
	p = append(p, kvRead(bus.BucketPools)...)
	// Proxy passwords the planner sealed to the gateways' curve key; the
	// gateway announces its public key under _recipient.
	p = append(p, kvRead(bus.BucketGatewayCreds)...)
	p = append(p, "$KV."+bus.BucketGatewayCreds+"."+events.ProbeRecipientKey)
	// The interception CA, shared by the gateways: read, and created by
	// the first gateway (a KV create is a publish to the key).
	p = append(p, kvRead(BucketGatewayCA)...)
	p = append(p, "$KV."+BucketGatewayCA+".cert", "$KV."+BucketGatewayCA+".key")
	for _, b := range []string{BucketGatewayCooldowns, BucketGatewaySessions} {
		p = append(p, kvRead(b)...)
		p = append(p, "$KV."+b+".>")
	}
	// Its own demand keys <pool>.<name> (never read) and its own request
	// log subject.
	p = append(p, "$JS.API.STREAM.INFO.KV_"+bus.BucketDemand, "$KV."+bus.BucketDemand+"."+events.DemandKey("*", name))
	p = append(p, events.GatewayLogSubject(name))
	return p
}

// GatewaySubscribe is what gateway name may subscribe to: its inbox, its
// own endpoints (fleet.gateway.<name>.info|stats|ca) and micro discovery.
func GatewaySubscribe(name string) []string {
	return []string{
		GatewayInbox(name) + ".>",
		events.GatewaySubject(name, events.GatewayInfo), events.GatewaySubject(name, events.GatewayStats),
		events.GatewaySubject(name, events.GatewayCA),
		"$SRV.>",
	}
}

func gatewayUser(name string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "      # Gateway %s: --name %s, seed %s.nk, --nats-inbox-prefix %s.\n", name, name, GatewayIdentity(name), GatewayInbox(name))
	fmt.Fprintf(&b, "      { nkey: $%s, permissions: {\n", EnvName(GatewayIdentity(name)))
	b.WriteString("          publish: [\n")
	quoteLines(&b, GatewayPublish(name), "            ")
	b.WriteString("          ]\n          subscribe: [\n")
	quoteLines(&b, GatewaySubscribe(name), "            ")
	b.WriteString("          ]\n          allow_responses: true\n      } }\n")
	return b.String()
}

func quoteLines(b *strings.Builder, subjects []string, indent string) {
	for i, s := range subjects {
		b.WriteString(indent + `"` + s + `"`)
		if i < len(subjects)-1 {
			b.WriteString(",")
		}
		b.WriteString("\n")
	}
}
