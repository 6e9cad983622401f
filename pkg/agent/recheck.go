package agent

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// recheckLoop lists the agent's instances every RecheckInterval, from the
// start on, and records failed (class terminated) for every proxy that is
// up as far as the log knows while its instance terminated or disappeared.
// The planner replaces a failed proxy at once, so a dead instance does not
// wait for health's unhealthyAfter or the planner's GC grace.
func (r *Runtime) recheckLoop(ctx context.Context) {
	if r.cfg.RecheckInterval < 0 {
		return
	}
	var seen map[string]Instance
	t := time.NewTicker(r.cfg.RecheckInterval)
	defer t.Stop()
	for {
		seen = r.recheck(ctx, seen)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// recheck runs one sweep. seen holds the instances of the previous
// successful List (nil before the first); it returns the instances of this
// one, or seen unchanged when List failed: absence from a failed or partial
// listing proves nothing.
func (r *Runtime) recheck(ctx context.Context, seen map[string]Instance) map[string]Instance {
	lctx, cancel := context.WithTimeout(ctx, r.cfg.CheckTimeout)
	list, err := r.drv.List(lctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			r.log.Warn("recheck: list instances", "err", err)
		}
		return seen
	}
	now := make(map[string]Instance, len(list))
	for _, inst := range list {
		if inst.Name == "" || inst.Marker.Entry != r.cfg.Info.Entry || !events.IsIdentifier(inst.Marker.ProxyID) {
			continue
		}
		now[inst.Name] = inst
		if inst.State == StateTerminated {
			detail := inst.Detail
			if detail == "" {
				detail = "the backend reports it no longer runs"
			}
			r.markFailed(ctx, inst.Marker.ProxyID, inst.Name, fmt.Sprintf("instance %s terminated: %s", inst.Name, detail))
		}
	}
	for name, inst := range seen {
		if _, ok := now[name]; !ok {
			r.markFailed(ctx, inst.Marker.ProxyID, name, fmt.Sprintf("instance %s disappeared", name))
		}
	}
	return now
}

// markFailed records failed (class terminated) for proxyID unless a command
// of that proxy is queued or running (the command's own outcome decides),
// the proxy is not up as far as the log knows, or it was placed by another
// entry or target. The check and the append run in the proxy's queue, so a
// command taken meanwhile waits for them. The Msg-Id is derived from the
// proxy's last event, so repeated sweeps append one failed event.
func (r *Runtime) markFailed(ctx context.Context, proxyID, name, reason string) {
	if r.queue.Busy(proxyID) {
		return
	}
	r.queue.Submit(proxyID, func() {
		if ctx.Err() != nil {
			return
		}
		last, err := r.lastEvent(ctx, proxyID)
		if err != nil {
			r.log.Warn("recheck: read proxy state", "proxy", proxyID, "err", err)
			return
		}
		if last == nil || !up(last.Kind) {
			return
		}
		// This agent's own provisioning: another agent's, on its own
		// subject, says nothing about this agent's instances.
		prov, err := r.store.LastObservation(ctx, proxyID, events.ProxyProvisioning, events.Observer{Entry: r.cfg.Info.Entry, Target: r.cfg.Info.Target})
		if err != nil {
			r.log.Warn("recheck: read proxy placement", "proxy", proxyID, "err", err)
			return
		}
		var p events.ProxyProvisioningData
		if prov == nil || prov.DecodeData(&p) != nil || p.Entry != r.cfg.Info.Entry || p.Target != r.cfg.Info.Target || p.Instance != name {
			return
		}
		r.appendTerminated(ctx, last, proxyID, p.Attempt, reason)
	})
}

// up reports whether a proxy whose last event is kind serves as far as the
// log knows.
func up(kind string) bool {
	return kind == events.ProxyRunning || kind == events.ProxyReady || kind == events.ProxyUnhealthy
}

func (r *Runtime) appendTerminated(ctx context.Context, last *bus.Event, proxyID string, attempt int, reason string) {
	ctx, span := r.tracer.Start(ctx, "agent.recheck", trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(attribute.String("proxy", proxyID), attribute.String("entry", r.cfg.Info.Entry), attribute.String("target", r.cfg.Info.Target)))
	defer span.End()
	data := events.ProxyFailedData{Class: events.ClassTerminated, Reason: reason, Attempt: attempt}
	id := events.ProxyEventID(proxyID, events.ProxyFailed, last.Seq) + "." + events.ClassTerminated
	// Expecting the event the proxy was judged by: a decision appended
	// meanwhile (the planner retiring it) makes the instance's death its
	// delete's business, and the next recheck judges again.
	err := r.publishExpecting(ctx, proxyID, events.ProxyFailed, id, data, &bus.Expect{Seq: last.Seq})
	if errors.Is(err, bus.ErrConflict) {
		r.log.DebugContext(ctx, "recheck: the proxy changed since it was judged; judging it again next time", "proxy", proxyID)
		return
	}
	if err != nil {
		spanFailed(ctx, err, "append failed")
		r.log.WarnContext(ctx, "recheck: publish failed; the next recheck tries again", "proxy", proxyID, "err", err)
		return
	}
	r.log.WarnContext(ctx, "proxy failed: its instance no longer runs", "proxy", proxyID, "class", events.ClassTerminated, "reason", reason)
}

// RecheckFlag registers --recheck-interval on fs, the flag every agent
// binary offers for [Config.RecheckInterval].
func RecheckFlag(fs *flag.FlagSet) *time.Duration {
	return fs.Duration("recheck-interval", DefaultRecheckInterval,
		"how often the agent lists its instances to fail proxies whose instance terminated or disappeared behind its back; it bounds that detection delay (negative: off)")
}

// KeyDirFlag registers --key-dir, the directory of the agents' curve key
// files ([Config.KeyDir]); empty means <data-dir>/keys.
func KeyDirFlag(fs *flag.FlagSet) *string {
	return fs.String("key-dir", "",
		"directory of this agent's curve (xkey) key files, one <entry>.<target>.xk per target, created 0600 on first start; the planner seals create commands' secrets to them, so keep them across restarts (default <data-dir>/keys)")
}

// KeyDirOr returns dir, or <dataDir>/keys when dir is empty.
func KeyDirOr(dir, dataDir string) string {
	if dir != "" {
		return dir
	}
	return filepath.Join(dataDir, "keys")
}
