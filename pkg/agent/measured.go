package agent

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// measured is a [Driver] that records the duration of every call of next
// in proxyfleet_agent_driver_call_duration_seconds, by op: create, delete,
// observe (Get), inventory (List) and check.
type measured struct {
	next          Driver
	calls         metric.Float64Histogram
	entry, target string
}

var _ Driver = measured{}

func (d measured) record(ctx context.Context, op string, started time.Time, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	d.calls.Record(context.WithoutCancel(ctx), time.Since(started).Seconds(), metric.WithAttributes(
		attribute.String("op", op), attribute.String("outcome", outcome),
		attribute.String("entry", d.entry), attribute.String("target", d.target)))
}

func (d measured) Create(ctx context.Context, spec Spec) (Instance, error) {
	started := time.Now()
	inst, err := d.next.Create(ctx, spec)
	d.record(ctx, "create", started, err)
	return inst, err
}

func (d measured) Get(ctx context.Context, ref Ref) (Instance, error) {
	started := time.Now()
	inst, err := d.next.Get(ctx, ref)
	d.record(ctx, "observe", started, err)
	return inst, err
}

func (d measured) Delete(ctx context.Context, ref Ref) error {
	started := time.Now()
	err := d.next.Delete(ctx, ref)
	d.record(ctx, "delete", started, err)
	return err
}

func (d measured) List(ctx context.Context) ([]Instance, error) {
	started := time.Now()
	list, err := d.next.List(ctx)
	d.record(ctx, "inventory", started, err)
	return list, err
}

func (d measured) Check(ctx context.Context) []Verdict {
	started := time.Now()
	v := d.next.Check(ctx)
	d.record(ctx, "check", started, nil)
	return v
}

// measure runs a driver call that is no method of [Driver] (a capability
// such as [Preparer]) and records its duration as op.
func (r *Runtime) measure(ctx context.Context, op string, call func() (string, error)) (string, error) {
	started := time.Now()
	out, err := call()
	r.drv.record(ctx, op, started, err)
	return out, err
}
