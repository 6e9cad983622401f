package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
)

// Stream and bucket names. Every definition lives in this file.
const (
	EventsStream   = "FLEET_EVENTS"
	CommandsStream = "FLEET_CMDS"

	BucketProxies = "fleet-proxies"
	BucketPools   = "fleet-pools"
	BucketTargets = "fleet-targets"
	BucketAgents  = "fleet-agents"
	BucketPlanner = "fleet-planner"
	BucketSecrets = "fleet-secrets"
	BucketProbes  = "fleet-probes"
	// BucketProbeCreds holds each pool's probe password sealed to the
	// health service's curve key (see events.ProbeCredential).
	BucketProbeCreds = "fleet-probe-creds"
	BucketVMIDs      = "fleet-vmids"
	// BucketGatewayCreds holds each pool's proxy password sealed to the
	// gateway's curve key, as BucketProbeCreds does for health.
	BucketGatewayCreds = "fleet-gateway-creds"
	// BucketGatewayCooldowns holds the proxies kept off a site by a
	// gateway's cooldown rule (events.GatewayCooldown under
	// events.CooldownKey), shared by every gateway.
	BucketGatewayCooldowns = "fleet-gateway-cooldowns"
	// BucketGatewayCA holds the fleet's gateway CA, which signs the
	// certificates of intercepted HTTPS: key "cert" its certificate (PEM,
	// public), key "key" its private key sealed to the gateways' curve
	// key. The first gateway to start creates both.
	BucketGatewayCA = "fleet-gateway-ca"
	// BucketGatewaySessions holds the gateways' sticky sessions under
	// "<pool>.<session id>", so every gateway serves a session on the same
	// proxy and a restarted one keeps serving it there. Each entry
	// expires on its own (a per-message TTL: the session's TTL from its
	// last use); the bucket allows message TTLs for it.
	BucketGatewaySessions = "fleet-gateway-sessions"
	// BucketDemand holds the demand each gateway sees per pool
	// (events.GatewayDemand under events.DemandKey), read by the planner
	// to size autoscaled pools.
	BucketDemand = "fleet-demand"
	// BucketHealth holds one key per live health replica, refreshed while
	// it runs: the members the replicas split the probing between.
	BucketHealth = "fleet-health"

	// ObjectSnapshots is the object store of state checkpoints: a cache
	// of FLEET_EVENTS (a snapshot names the sequence it covers), never a
	// source of truth.
	ObjectSnapshots = "fleet-snapshots"
)

// Timing of the shared definitions.
const (
	// DuplicateWindow is how long a repeated Nats-Msg-Id is dropped.
	DuplicateWindow = 2 * time.Minute
	// AgentTTL is how long an agent heartbeat stays in fleet-agents.
	AgentTTL = 15 * time.Second
	// LeaseTTL is how long the planner leader lease lasts without renewal.
	LeaseTTL = 10 * time.Second
	// CommandTTL is the default per-message TTL of a command: a command
	// nobody consumed in this time is stale and expires.
	CommandTTL = 30 * time.Minute
	// HealthMemberTTL is how long a health replica stays a member of
	// fleet-health without renewing its key: a replica that dies without
	// leaving hands its proxies over to the others after at most this long.
	HealthMemberTTL = 3 * time.Second
	// DemandTTL is how long a gateway's demand report stays in
	// fleet-demand: a gateway that stopped no longer counts after it.
	DemandTTL = 15 * time.Second
	// GatewayCooldownTTL is how long fleet-gateway-cooldowns keeps an
	// entry: the longest cooldown and the longest span retireAfterSites
	// counts over. Each entry's own "until" ends its cooldown exactly.
	GatewayCooldownTTL = 24 * time.Hour
	// SessionMarkerTTL is how long fleet-gateway-sessions keeps the marker
	// of a session that expired, which tells the gateways' watchers.
	SessionMarkerTTL = time.Minute
)

// EnsureTopology creates or updates every stream and bucket. It is safe to
// call from every service at every start.
func EnsureTopology(ctx context.Context, c *Conn) error {
	r := c.replicas
	streams := []jetstream.StreamConfig{
		{
			Name:        EventsStream,
			Description: "proxyfleet domain events: the source of truth",
			Subjects:    []string{events.EventsAll},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			Duplicates:  DuplicateWindow,
			DenyDelete:  true,
			DenyPurge:   true,
			AllowDirect: true,
			// Leader fencing (fence.go): decisions are atomic batches
			// with a fence message that expires on its own.
			AllowAtomicPublish: true,
			AllowMsgTTL:        true,
			Replicas:           r,
		},
		{
			Name:        CommandsStream,
			Description: "proxyfleet backend commands, one consumer per agent",
			Subjects:    []string{events.CommandsAll},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.WorkQueuePolicy,
			Duplicates:  DuplicateWindow,
			AllowMsgTTL: true,
			MaxAge:      24 * time.Hour,
			Replicas:    r,
		},
	}
	for _, cfg := range streams {
		if _, err := c.JS.CreateOrUpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("stream %s: %w", cfg.Name, err)
		}
	}
	if err := ensureRequestLog(ctx, c); err != nil {
		return err
	}
	buckets := []jetstream.KeyValueConfig{
		{Bucket: BucketProxies, Description: "view: one key per proxy", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketPools, Description: "view: one key per pool", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketTargets, Description: "view: agent checks per target", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketProbes, Description: "health probe counters per proxy", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketAgents, Description: "agent heartbeats", History: 1, TTL: AgentTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketPlanner, Description: "planner leader lease", History: 1, TTL: LeaseTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketSecrets, Description: "pool secrets (user-data, proxy passwords), never in the event log", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketProbeCreds, Description: "pool probe passwords sealed to the health service's curve key; health's public key under _recipient", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketGatewayCreds, Description: "pool proxy passwords sealed to the gateway's curve key; the gateway's public key under _recipient", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketGatewayCooldowns, Description: "proxies kept off a site by a gateway's cooldown rule, shared by every gateway; each entry ends at its until", History: 1, TTL: GatewayCooldownTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketGatewayCA, Description: "the gateways' CA for intercepted HTTPS: its certificate under cert, its key sealed to the gateways' curve key under key", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketGatewaySessions, Description: "the gateways' sticky sessions (pool, id: proxy, uses, pinned at, last used), each expiring with its session TTL",
			History: 1, LimitMarkerTTL: SessionMarkerTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketDemand, Description: "per-pool demand each gateway sees, read by the planner to autoscale pools", History: 1, TTL: DemandTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketVMIDs, Description: "Proxmox VMID reservations", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketHealth, Description: "live health replicas, which split the probing between them", History: 1, TTL: HealthMemberTTL, Storage: jetstream.FileStorage, Replicas: r},
	}
	for _, cfg := range buckets {
		if _, err := c.JS.CreateOrUpdateKeyValue(ctx, cfg); err != nil {
			return fmt.Errorf("bucket %s: %w", cfg.Bucket, err)
		}
	}
	objects := []jetstream.ObjectStoreConfig{
		// Snapshots are JSON: the server compresses them at rest.
		{Bucket: ObjectSnapshots, Description: "state checkpoints of FLEET_EVENTS readers (the planner's); a cache, rebuildable from the log",
			Storage: jetstream.FileStorage, Compression: true, Replicas: r},
	}
	for _, cfg := range objects {
		if _, err := c.JS.CreateOrUpdateObjectStore(ctx, cfg); err != nil {
			return fmt.Errorf("object store %s: %w", cfg.Bucket, err)
		}
	}
	return nil
}

// AgentConsumerName is the durable consumer of one agent: "agent-<entry>-<target>".
func AgentConsumerName(entry, target string) string { return "agent-" + entry + "-" + target }

// AgentAckWait is how long a command may go without an ack or InProgress
// before it is redelivered.
const AgentAckWait = 15 * time.Second

// AgentMaxDeliver bounds deliveries of one command: on the last one the
// agent records a transient failure as failed (class dead-letter). A
// command never delivered again is covered by the planner's create and
// retire timeouts, which re-issue it.
const AgentMaxDeliver = 10

// EnsureAgentConsumer creates or updates the durable pull consumer that
// delivers the commands of one agent. On a connection that may not create
// ([Conn.MayCreate] false) it binds the existing consumer instead, and a
// missing one is an error naming the bootstrap command.
func EnsureAgentConsumer(ctx context.Context, c *Conn, entry, target string) (jetstream.Consumer, error) {
	if !c.MayCreate() {
		return BindConsumer(ctx, c, CommandsStream, AgentConsumerName(entry, target))
	}
	return c.JS.CreateOrUpdateConsumer(ctx, CommandsStream, AgentConsumerConfig(entry, target, c.replicas))
}

// BindConsumer returns the existing durable consumer name of stream, or an
// error naming the bootstrap command when it does not exist.
func BindConsumer(ctx context.Context, c *Conn, stream, name string) (jetstream.Consumer, error) {
	cons, err := c.JS.Consumer(ctx, stream, name)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, fmt.Errorf("durable consumer %s on stream %s does not exist, and this service may not create it (--ensure-topology=false): %s", name, stream, BootstrapHint)
	case err != nil:
		return nil, fmt.Errorf("bind durable consumer %s on stream %s: %w", name, stream, err)
	}
	return cons, nil
}

// AgentConsumerConfig is the definition of one agent's command consumer.
func AgentConsumerConfig(entry, target string, replicas int) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       AgentConsumerName(entry, target),
		Description:   "commands for " + entry + "/" + target,
		FilterSubject: events.CommandFilter(entry, target),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       AgentAckWait,
		MaxDeliver:    AgentMaxDeliver,
		BackOff:       nil,
		MaxAckPending: 256,
		Replicas:      replicas,
	}
}

// HealthProjection is health's durable consumer of FLEET_EVENTS, which
// projects the event log into fleet-proxies and fleet-pools, and
// HealthProjectionGroup its one priority group.
const (
	HealthProjection      = "health-projection"
	HealthProjectionGroup = "projection"
	// HealthProjectionAckWait is how long a projected event may stay
	// unacknowledged before it is delivered again.
	HealthProjectionAckWait = 30 * time.Second
	// HealthProjectionPinnedTTL is how long the server keeps the consumer
	// pinned to a projector that stopped pulling.
	HealthProjectionPinnedTTL = 30 * time.Second
	// HealthProjectionMaxAckPending bounds the events in flight to the
	// pinned projector.
	HealthProjectionMaxAckPending = 4096
)

// HealthProjectionConfig is the definition of [HealthProjection]: one
// pinned projector at a time (see services/health/internal/projection).
func HealthProjectionConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:        HealthProjection,
		Description:    "health: projection of FLEET_EVENTS into fleet-proxies and fleet-pools",
		FilterSubject:  events.EventsAll,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        HealthProjectionAckWait,
		MaxAckPending:  HealthProjectionMaxAckPending,
		PriorityPolicy: jetstream.PriorityPolicyPinned,
		PriorityGroups: []string{HealthProjectionGroup},
		PinnedTTL:      HealthProjectionPinnedTTL,
		// Replicas 0: the consumer follows the stream's replica count.
	}
}

// Bootstrap creates or updates everything the services bind and may not
// create under deploy/nats: the streams, buckets and object store
// ([EnsureTopology]), health's projection consumer and the command consumer
// of each agent, given as "entry/target".
func Bootstrap(ctx context.Context, c *Conn, agents []string) error {
	if err := EnsureTopology(ctx, c); err != nil {
		return err
	}
	if _, err := c.JS.CreateOrUpdateConsumer(ctx, EventsStream, HealthProjectionConfig()); err != nil {
		return fmt.Errorf("consumer %s: %w", HealthProjection, err)
	}
	for _, a := range agents {
		entry, target, err := ParseAgent(a)
		if err != nil {
			return err
		}
		if _, err := c.JS.CreateOrUpdateConsumer(ctx, CommandsStream, AgentConsumerConfig(entry, target, c.replicas)); err != nil {
			return fmt.Errorf("consumer %s: %w", AgentConsumerName(entry, target), err)
		}
	}
	return nil
}

// ParseAgent splits "entry/target" (an agent's entry name and target id,
// each one subject token).
func ParseAgent(s string) (entry, target string, err error) {
	entry, target, ok := strings.Cut(s, "/")
	if !ok || !validToken(entry) || !validToken(target) {
		return "", "", fmt.Errorf("agent %q: want ENTRY/TARGET, e.g. local/t1 (each a non-empty NATS subject token: no '.', '*', '>', '/' or space)", s)
	}
	return entry, target, nil
}

func validToken(s string) bool {
	return s != "" && !strings.ContainsAny(s, "./*> \t\r\n")
}
