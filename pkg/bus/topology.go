package bus

import (
	"context"
	"fmt"
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
	buckets := []jetstream.KeyValueConfig{
		{Bucket: BucketProxies, Description: "view: one key per proxy", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketPools, Description: "view: one key per pool", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketTargets, Description: "view: agent checks per target", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketProbes, Description: "health probe counters per proxy", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketAgents, Description: "agent heartbeats", History: 1, TTL: AgentTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketPlanner, Description: "planner leader lease", History: 1, TTL: LeaseTTL, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketSecrets, Description: "pool secrets (user-data, proxy passwords), never in the event log", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketProbeCreds, Description: "pool probe passwords sealed to the health service's curve key; health's public key under _recipient", History: 1, Storage: jetstream.FileStorage, Replicas: r},
		{Bucket: BucketVMIDs, Description: "Proxmox VMID reservations", History: 1, Storage: jetstream.FileStorage, Replicas: r},
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
// delivers the commands of one agent.
func EnsureAgentConsumer(ctx context.Context, c *Conn, entry, target string) (jetstream.Consumer, error) {
	return c.JS.CreateOrUpdateConsumer(ctx, CommandsStream, jetstream.ConsumerConfig{
		Durable:       AgentConsumerName(entry, target),
		Description:   "commands for " + entry + "/" + target,
		FilterSubject: events.CommandFilter(entry, target),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       AgentAckWait,
		MaxDeliver:    AgentMaxDeliver,
		BackOff:       nil,
		MaxAckPending: 256,
		Replicas:      c.replicas,
	})
}
