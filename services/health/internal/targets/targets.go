// Package targets polls the check endpoint of every live agent and keeps
// the answers in the fleet-targets bucket, one key per "<entry>.<target>",
// so an operator sees each target's health next to the proxies it hosts.
// One agent that does not answer is recorded as an error and never delays
// the others.
package targets

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Config tunes a [Checker]. Zero values take the defaults noted.
type Config struct {
	// Interval between two rounds of checks (default 30s).
	Interval time.Duration
	// Timeout bounds one agent's answer (default 10s).
	Timeout time.Duration
	// Concurrency bounds requests in flight (default 16).
	Concurrency int
}

func (c *Config) defaults() {
	if c.Interval <= 0 {
		c.Interval = 30 * time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = 10 * time.Second
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 16
	}
}

// Record is the fleet-targets value of one target; its wire shape is
// shared with the planner, which reads it.
type Record = agent.TargetCheck

// Checker polls the agents. Create it with [New].
type Checker struct {
	conn *bus.Conn
	cfg  Config
	log  *slog.Logger
}

// New returns a checker using c.
func New(c *bus.Conn, cfg Config, log *slog.Logger) *Checker {
	cfg.defaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Checker{conn: c, cfg: cfg, log: log.With("component", "targets")}
}

// Run checks every agent now and then every Interval until ctx ends.
func (c *Checker) Run(ctx context.Context) error {
	t := time.NewTicker(c.cfg.Interval)
	defer t.Stop()
	for {
		if err := c.CheckAll(ctx); err != nil && ctx.Err() == nil {
			c.log.Warn("target checks", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// CheckAll runs one round: it asks every agent listed in fleet-agents for
// its check verdicts, stores each answer (or the error) in fleet-targets,
// and removes the records of agents that are no longer live.
func (c *Checker) CheckAll(ctx context.Context) error {
	agents, err := c.conn.JS.KeyValue(ctx, bus.BucketAgents)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketAgents, err)
	}
	out, err := c.conn.JS.KeyValue(ctx, bus.BucketTargets)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bus.BucketTargets, err)
	}
	live := map[string]agent.Heartbeat{}
	listed := map[string]bool{}
	keys, err := agents.ListKeys(ctx)
	if err != nil {
		return fmt.Errorf("list agents: %w", err)
	}
	for k := range keys.Keys() {
		listed[k] = true
		e, err := agents.Get(ctx, k)
		if err != nil {
			continue // expired between listing and reading
		}
		var hb agent.Heartbeat
		if err := json.Unmarshal(e.Value(), &hb); err != nil || !events.IsIdentifier(hb.Entry) || !events.IsIdentifier(hb.Target) {
			c.log.Warn("agent heartbeat does not decode; not checking it", "key", k)
			continue
		}
		if hb.Entry == events.ProviderExternal {
			// External proxies have no agent: the planner speaks for
			// them, and no agent may serve that entry.
			c.log.Warn("a heartbeat claims the entry of external proxies; not checking it (no agent may serve it)", "key", k, "target", hb.Target)
			continue
		}
		live[agent.HeartbeatKey(hb.Entry, hb.Target)] = hb
	}

	sem := make(chan struct{}, c.cfg.Concurrency)
	var wg sync.WaitGroup
	for key, hb := range live {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			rec := c.check(ctx, hb.Entry, hb.Target)
			b, _ := json.Marshal(rec)
			if _, err := out.Put(ctx, key, b); err != nil && ctx.Err() == nil {
				c.log.Warn("store target check", "entry", hb.Entry, "target", hb.Target, "err", err)
			}
		}()
	}
	wg.Wait()

	old, err := out.ListKeys(ctx)
	if err != nil {
		return nil
	}
	for k := range old.Keys() {
		if _, ok := live[k]; ok {
			continue
		}
		// The listing of agents can miss a heartbeat that was being
		// rewritten as it ran ([bus.Held]): the record of an agent it
		// did not list goes only once that agent's key reads as gone.
		if !listed[k] {
			if held, err := bus.Held(ctx, agents, k); err != nil || held {
				continue
			}
		}
		_ = out.Delete(ctx, k)
	}
	return nil
}

// check asks one agent for its verdicts.
func (c *Checker) check(ctx context.Context, entry, target string) Record {
	rec := Record{Entry: entry, Target: target, Verdicts: []agent.Verdict{}}
	rctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	msg, err := c.conn.NC.RequestWithContext(rctx, events.AgentSubject(entry, target, events.AgentCheck), nil)
	rec.At = time.Now().UTC()
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		rec.Error = "no agent answers " + events.AgentSubject(entry, target, events.AgentCheck)
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout):
		rec.Error = fmt.Sprintf("the agent did not answer its check within %s", c.cfg.Timeout)
	case err != nil:
		rec.Error = err.Error()
	default:
		if aerr := api.ReplyError(msg); aerr != nil {
			rec.Error = fmt.Sprintf("the agent answered error %s: %s", aerr.Status, aerr.Message)
		} else if err := json.Unmarshal(msg.Data, &rec.Verdicts); err != nil {
			rec.Verdicts = []agent.Verdict{}
			rec.Error = "the agent's check answer does not decode: " + err.Error()
		}
	}
	if rec.Error != "" {
		c.log.Warn("target check failed", "entry", entry, "target", target, "err", rec.Error)
	}
	rec.OK = rec.Error == ""
	for _, v := range rec.Verdicts {
		rec.OK = rec.OK && v.OK
	}
	return rec
}
