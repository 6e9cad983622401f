package bus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/events"
)

// RequestLogStream is the gateways' request log: one
// [events.GatewayRequest] per client request, on
// [events.GatewayLogSubject]. It is bounded by age and size and drops its
// oldest records first: a diagnostic log, never a source of truth.
const RequestLogStream = "FLEET_GATEWAY_LOG"

// Default bounds of [RequestLogStream].
const (
	DefaultRequestLogMaxAge   = 24 * time.Hour
	DefaultRequestLogMaxBytes = 1 << 30
	// RequestLogMaxRecord bounds one record; a record carries no body, so
	// only a pathological URL path comes near it.
	RequestLogMaxRecord = 16 << 10
)

// RequestLogLimits bound [RequestLogStream]: records older than MaxAge,
// and the oldest records past MaxBytes or MaxMsgs, are dropped. Zero
// MaxAge or MaxBytes means the default; MaxMsgs 0 means no bound by count.
type RequestLogLimits struct {
	MaxAge   time.Duration
	MaxBytes int64
	MaxMsgs  int64
}

func (l RequestLogLimits) orDefault() RequestLogLimits {
	if l.MaxAge == 0 {
		l.MaxAge = DefaultRequestLogMaxAge
	}
	if l.MaxBytes == 0 {
		l.MaxBytes = DefaultRequestLogMaxBytes
	}
	if l.MaxMsgs == 0 {
		l.MaxMsgs = -1
	}
	return l
}

// Check reports why l cannot bound the request log, or nil.
func (l RequestLogLimits) Check() error {
	switch {
	case l.MaxAge < 0:
		return fmt.Errorf("request log max age %s: want more than 0 (0: the default %s)", l.MaxAge, DefaultRequestLogMaxAge)
	case l.MaxAge > 0 && l.MaxAge < time.Minute:
		return fmt.Errorf("request log max age %s: want at least 1m", l.MaxAge)
	case l.MaxBytes < 0:
		return fmt.Errorf("request log max bytes %d: want more than 0 (0: the default %d)", l.MaxBytes, DefaultRequestLogMaxBytes)
	case l.MaxBytes > 0 && l.MaxBytes < 1<<20:
		return fmt.Errorf("request log max bytes %d: want at least 1 MiB (1048576)", l.MaxBytes)
	case l.MaxMsgs < 0:
		return fmt.Errorf("request log max messages %d: want 0 (no bound) or more", l.MaxMsgs)
	}
	return nil
}

// RequestLogConfig is the definition of [RequestLogStream] with limits l.
func RequestLogConfig(l RequestLogLimits, replicas int) jetstream.StreamConfig {
	l = l.orDefault()
	return jetstream.StreamConfig{
		Name:        RequestLogStream,
		Description: "gateway request log: one record per client request, bounded by age and size, oldest dropped first",
		Subjects:    []string{events.GatewayLogAll},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		MaxAge:      l.MaxAge,
		MaxBytes:    l.MaxBytes,
		MaxMsgs:     l.MaxMsgs,
		MaxMsgSize:  RequestLogMaxRecord,
		AllowDirect: true,
		Replicas:    replicas,
	}
}

// ensureRequestLog creates [RequestLogStream] with the default limits, or
// updates it keeping the limits it has: they are an operator's setting
// ([SetRequestLogLimits]), which a service starting with
// --ensure-topology must not reset.
func ensureRequestLog(ctx context.Context, c *Conn) error {
	cfg := RequestLogConfig(RequestLogLimits{}, c.replicas)
	s, err := c.JS.Stream(ctx, RequestLogStream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		_, err = c.JS.CreateStream(ctx, cfg)
	case err == nil:
		have := s.CachedInfo().Config
		cfg.MaxAge, cfg.MaxBytes, cfg.MaxMsgs = have.MaxAge, have.MaxBytes, have.MaxMsgs
		_, err = c.JS.UpdateStream(ctx, cfg)
	}
	if err != nil {
		return fmt.Errorf("stream %s: %w", RequestLogStream, err)
	}
	return nil
}

// SetRequestLogLimits creates or updates [RequestLogStream] with limits l
// (`planner bootstrap --request-log-max-age ... --request-log-max-bytes
// ...`); a zero limit keeps the stream's current one. Records past the new
// bounds are dropped at once.
func SetRequestLogLimits(ctx context.Context, c *Conn, l RequestLogLimits) error {
	if err := l.Check(); err != nil {
		return err
	}
	if s, err := c.JS.Stream(ctx, RequestLogStream); err == nil {
		have := s.CachedInfo().Config
		if l.MaxAge == 0 {
			l.MaxAge = have.MaxAge
		}
		if l.MaxBytes == 0 {
			l.MaxBytes = have.MaxBytes
		}
		if l.MaxMsgs == 0 {
			l.MaxMsgs = have.MaxMsgs
		}
	}
	if _, err := c.JS.CreateOrUpdateStream(ctx, RequestLogConfig(l, c.replicas)); err != nil {
		return fmt.Errorf("stream %s: %w", RequestLogStream, err)
	}
	return nil
}
