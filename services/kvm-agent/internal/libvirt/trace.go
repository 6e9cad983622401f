package libvirt

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"proxyfleet/pkg/agent"
)

// Traced wraps next so that every RPC gets one span and one log line named
// after the libvirt function (rpc=virDomainLookupByName), with the names it
// was given, its duration and, on failure, the error with its libvirt code.
// Domain and volume XML and metadata are logged only when verbose is set;
// upload bodies and seed contents never are.
func Traced(next RPC, log *slog.Logger, tracer trace.Tracer, verbose bool) RPC {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if tracer == nil {
		tracer = noop.NewTracerProvider().Tracer("")
	}
	return &traced{next: next, log: log, tracer: tracer, verbose: verbose}
}

type traced struct {
	next    RPC
	log     *slog.Logger
	tracer  trace.Tracer
	verbose bool
}

var _ RPC = (*traced)(nil)

// span runs fn as rpc. attrs are key/value pairs safe to log; xml, when
// verbose, is added to the log line only.
func (t *traced) span(ctx context.Context, rpc string, attrs []any, xml string, fn func(ctx context.Context) error) error {
	ctx, span := t.tracer.Start(ctx, rpc, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("rpc.system", "libvirt"), attribute.String("rpc.method", rpc)))
	defer span.End()
	for i := 0; i+1 < len(attrs); i += 2 {
		if k, ok := attrs[i].(string); ok {
			if v, ok := attrs[i+1].(string); ok {
				span.SetAttributes(attribute.String("libvirt."+k, v))
			}
		}
	}
	start := time.Now()
	err := fn(ctx)
	args := append([]any{"rpc", rpc}, attrs...)
	args = append(args, "duration_ms", float64(time.Since(start).Microseconds())/1000)
	if t.verbose && xml != "" {
		args = append(args, "xml", xml)
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "libvirt call failed")
		args = append(args, "err", err.Error(), "class", agent.Classify(Classify(err)))
		var le *Error
		if errors.As(err, &le) {
			args = append(args, "libvirtCode", le.Code, "libvirtError", CodeName(le.Code))
			span.SetAttributes(attribute.Int("libvirt.code", int(le.Code)))
		}
		level := slog.LevelWarn
		if IsNotFound(err) {
			level = slog.LevelDebug // lookups of things that are not there are normal
		}
		t.log.Log(ctx, level, "libvirt call", args...)
		return err
	}
	t.log.Log(ctx, slog.LevelDebug, "libvirt call", args...)
	return nil
}

func (t *traced) ConnectGetLibVersion(ctx context.Context) (v uint64, err error) {
	err = t.span(ctx, "virConnectGetLibVersion", nil, "", func(ctx context.Context) (e error) { v, e = t.next.ConnectGetLibVersion(ctx); return })
	return
}

func (t *traced) ConnectGetHostname(ctx context.Context) (s string, err error) {
	err = t.span(ctx, "virConnectGetHostname", nil, "", func(ctx context.Context) (e error) { s, e = t.next.ConnectGetHostname(ctx); return })
	return
}

func (t *traced) ConnectListAllDomains(ctx context.Context) (d []Domain, err error) {
	err = t.span(ctx, "virConnectListAllDomains", nil, "", func(ctx context.Context) (e error) { d, e = t.next.ConnectListAllDomains(ctx); return })
	return
}

func (t *traced) StoragePoolLookupByName(ctx context.Context, name string) (p StoragePool, err error) {
	err = t.span(ctx, "virStoragePoolLookupByName", []any{"pool", name}, "", func(ctx context.Context) (e error) { p, e = t.next.StoragePoolLookupByName(ctx, name); return })
	return
}

func (t *traced) StoragePoolGetInfo(ctx context.Context, pool StoragePool) (st uint8, av uint64, err error) {
	err = t.span(ctx, "virStoragePoolGetInfo", []any{"pool", pool.Name}, "", func(ctx context.Context) (e error) { st, av, e = t.next.StoragePoolGetInfo(ctx, pool); return })
	return
}

func (t *traced) StorageVolLookupByName(ctx context.Context, pool StoragePool, name string) (v StorageVol, err error) {
	err = t.span(ctx, "virStorageVolLookupByName", []any{"pool", pool.Name, "volume", name}, "", func(ctx context.Context) (e error) {
		v, e = t.next.StorageVolLookupByName(ctx, pool, name)
		return
	})
	return
}

func (t *traced) StorageVolCreateXML(ctx context.Context, pool StoragePool, xml string) (v StorageVol, err error) {
	err = t.span(ctx, "virStorageVolCreateXML", []any{"pool", pool.Name}, xml, func(ctx context.Context) (e error) { v, e = t.next.StorageVolCreateXML(ctx, pool, xml); return })
	return
}

func (t *traced) StorageVolGetPath(ctx context.Context, vol StorageVol) (p string, err error) {
	err = t.span(ctx, "virStorageVolGetPath", []any{"volume", vol.Name}, "", func(ctx context.Context) (e error) { p, e = t.next.StorageVolGetPath(ctx, vol); return })
	return
}

func (t *traced) StorageVolDelete(ctx context.Context, vol StorageVol) error {
	return t.span(ctx, "virStorageVolDelete", []any{"volume", vol.Name}, "", func(ctx context.Context) error { return t.next.StorageVolDelete(ctx, vol) })
}

func (t *traced) StorageVolUpload(ctx context.Context, vol StorageVol, r io.Reader, length uint64) error {
	return t.span(ctx, "virStorageVolUpload", []any{"volume", vol.Name, "bytes", length}, "", func(ctx context.Context) error {
		return t.next.StorageVolUpload(ctx, vol, r, length)
	})
}

func (t *traced) StorageVolDownload(ctx context.Context, vol StorageVol, max uint64) (b []byte, err error) {
	err = t.span(ctx, "virStorageVolDownload", []any{"volume", vol.Name}, "", func(ctx context.Context) (e error) { b, e = t.next.StorageVolDownload(ctx, vol, max); return })
	return
}

func (t *traced) DomainLookupByName(ctx context.Context, name string) (d Domain, err error) {
	err = t.span(ctx, "virDomainLookupByName", []any{"domain", name}, "", func(ctx context.Context) (e error) { d, e = t.next.DomainLookupByName(ctx, name); return })
	return
}

func (t *traced) DomainDefineXML(ctx context.Context, xml string) (d Domain, err error) {
	err = t.span(ctx, "virDomainDefineXML", nil, xml, func(ctx context.Context) (e error) { d, e = t.next.DomainDefineXML(ctx, xml); return })
	return
}

func (t *traced) DomainCreate(ctx context.Context, dom Domain) error {
	return t.span(ctx, "virDomainCreate", []any{"domain", dom.Name}, "", func(ctx context.Context) error { return t.next.DomainCreate(ctx, dom) })
}

func (t *traced) DomainGetState(ctx context.Context, dom Domain) (s int32, err error) {
	err = t.span(ctx, "virDomainGetState", []any{"domain", dom.Name}, "", func(ctx context.Context) (e error) { s, e = t.next.DomainGetState(ctx, dom); return })
	return
}

func (t *traced) DomainDestroy(ctx context.Context, dom Domain) error {
	return t.span(ctx, "virDomainDestroy", []any{"domain", dom.Name}, "", func(ctx context.Context) error { return t.next.DomainDestroy(ctx, dom) })
}

func (t *traced) DomainUndefineFlags(ctx context.Context, dom Domain) error {
	return t.span(ctx, "virDomainUndefineFlags", []any{"domain", dom.Name}, "", func(ctx context.Context) error { return t.next.DomainUndefineFlags(ctx, dom) })
}

func (t *traced) DomainGetMetadata(ctx context.Context, dom Domain, uri string) (md string, err error) {
	err = t.span(ctx, "virDomainGetMetadata", []any{"domain", dom.Name}, "", func(ctx context.Context) (e error) { md, e = t.next.DomainGetMetadata(ctx, dom, uri); return })
	return
}

func (t *traced) DomainInterfaceAddresses(ctx context.Context, dom Domain, source uint32) (ifs []DomainInterface, err error) {
	err = t.span(ctx, "virDomainInterfaceAddresses", []any{"domain", dom.Name, "source", sourceName(source)}, "", func(ctx context.Context) (e error) {
		ifs, e = t.next.DomainInterfaceAddresses(ctx, dom, source)
		return
	})
	return
}

func sourceName(s uint32) string {
	switch s {
	case SourceLease:
		return "lease"
	case SourceAgent:
		return "agent"
	case SourceARP:
		return "arp"
	}
	return "unknown"
}
