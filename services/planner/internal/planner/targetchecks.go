package planner

import (
	"context"
	"encoding/json"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/services/planner/internal/decide"
)

// checkOf is what placement reads of a target's latest check record.
func checkOf(rec agent.TargetCheck) *decide.Check {
	c := &decide.Check{OK: rec.OK, At: rec.At}
	if rec.Error != "" {
		c.Failing = append(c.Failing, "check request: "+decide.Truncate(rec.Error, 120))
	}
	for _, v := range rec.Verdicts {
		if v.OK {
			continue
		}
		s := v.Check
		if v.Detail != "" {
			s += ": " + decide.Truncate(v.Detail, 120)
		}
		c.Failing = append(c.Failing, s)
	}
	if !c.OK && len(c.Failing) == 0 {
		c.Failing = []string{"not ok"}
	}
	return c
}

// watchTargets keeps p.checks current from the fleet-targets bucket,
// where health records each live target's last check verdicts.
func (p *Planner) watchTargets(ctx context.Context, kv jetstream.KeyValue) {
	for ctx.Err() == nil {
		w, err := kv.WatchAll(ctx)
		if err != nil {
			p.log.Warn("watch fleet-targets", "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
				continue
			}
		}
		_ = bus.EachUpdate(ctx, w, func(e jetstream.KeyValueEntry) {
			if e != nil {
				p.onTargetCheck(e)
			}
		})
		bus.StopWatch(w)
	}
}

func (p *Planner) onTargetCheck(e jetstream.KeyValueEntry) {
	key := e.Key()
	if _, _, ok := splitAgentKey(key); !ok {
		return
	}
	p.mu.Lock()
	prev, had := p.checks[key]
	if e.Operation() != jetstream.KeyValuePut {
		delete(p.checks, key)
		p.mu.Unlock()
		return
	}
	var rec agent.TargetCheck
	if err := json.Unmarshal(e.Value(), &rec); err != nil {
		p.mu.Unlock()
		p.log.Warn("ignoring an unreadable target check record", "key", key, "err", err)
		return
	}
	c := checkOf(rec)
	p.checks[key] = c
	p.mu.Unlock()
	if (!had || prev.OK != c.OK) && p.caughtUp.Load() {
		// A target that passes again can take the proxies a pool misses.
		p.poke()
	}
}
