package gce

import (
	"log/slog"
	"net/http"
	"time"
)

// wireLog is an http.RoundTripper that logs one debug line per Compute API
// call through an allowlist: method, URL path, status and duration. It never
// reads headers (tokens), query strings or bodies (user-data, keys), so no
// log level can make it print a secret.
type wireLog struct {
	base http.RoundTripper
	log  *slog.Logger
}

func (w wireLog) RoundTrip(req *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := w.base.RoundTrip(req)
	attrs := []slog.Attr{
		slog.String("method", req.Method),
		slog.String("path", req.URL.Path),
		slog.String("duration", time.Since(start).Round(time.Microsecond).String()),
	}
	if err != nil {
		// A transport error's text may quote the full URL; the line says
		// only that the call failed, the caller reports the error itself.
		w.log.LogAttrs(req.Context(), slog.LevelDebug, "gce api call failed", attrs...)
		return resp, err
	}
	attrs = append(attrs, slog.Int("status", resp.StatusCode))
	w.log.LogAttrs(req.Context(), slog.LevelDebug, "gce api call", attrs...)
	return resp, nil
}
