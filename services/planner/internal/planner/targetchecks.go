package planner

import (
	"encoding/json"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
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

func (p *Planner) onTargetCheck(e jetstream.KeyValueEntry) {
	key := e.Key()
	if _, _, ok := splitAgentKey(key); !ok {
		return
	}
	p.mu.Lock()
	prev, had := p.health.checks[key]
	if e.Operation() != jetstream.KeyValuePut {
		delete(p.health.checks, key)
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
	p.health.checks[key] = c
	p.mu.Unlock()
	if (!had || prev.OK != c.OK) && p.caughtUp.Load() {
		// A target that passes again can take the proxies a pool misses.
		p.poke()
	}
}
