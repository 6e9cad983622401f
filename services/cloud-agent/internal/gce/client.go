// Package gce is the cloud-agent's Google Compute Engine backend: an
// [agent.Driver] that keeps one instance per proxy in one zone, with the
// proxyfleet marker as labels, cloud-init user-data in metadata, idempotent
// inserts by requestId, and error classes for quota, stockout, not-found and
// rate limits.
package gce

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"

	"golang.org/x/oauth2"
	"golang.org/x/oauth2/google"
	"google.golang.org/api/compute/v1"
	"google.golang.org/api/option"
)

// ServiceOptions say how to reach the Compute API.
type ServiceOptions struct {
	// CredentialsFile is a service-account key file; empty uses application
	// default credentials.
	CredentialsFile string
	// Endpoint overrides the API base URL (".../compute/v1/").
	Endpoint string
	// Transport is the base HTTP transport (default http.DefaultTransport).
	Transport http.RoundTripper
	// NoAuth sends requests without credentials (tests, emulators).
	NoAuth bool
}

// NewService returns a Compute API client whose every HTTP call passes the
// allowlist wire logger at debug level. Tokens are added below the logger and
// are never visible to it.
func NewService(ctx context.Context, o ServiceOptions, log *slog.Logger) (*compute.Service, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	base := o.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	rt := base
	if !o.NoAuth {
		creds, err := credentials(ctx, o.CredentialsFile)
		if err != nil {
			return nil, err
		}
		rt = &oauth2.Transport{Source: creds.TokenSource, Base: base}
	}
	opts := []option.ClientOption{
		option.WithHTTPClient(&http.Client{Transport: wireLog{base: rt, log: log}}),
		// The library's own request logging (GOOGLE_SDK_GO_LOGGING_LEVEL)
		// prints bodies; only the allowlist logger may speak.
		option.WithLogger(slog.New(slog.DiscardHandler)),
	}
	if o.Endpoint != "" {
		opts = append(opts, option.WithEndpoint(o.Endpoint))
	}
	svc, err := compute.NewService(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("compute client: %w", err)
	}
	return svc, nil
}

// credentials loads a service-account key file, or application default
// credentials when path is empty. Only service-account keys are accepted
// from a file: other credential types can make the library fetch URLs the
// file names.
func credentials(ctx context.Context, path string) (*google.Credentials, error) {
	if path == "" {
		c, err := google.FindDefaultCredentials(ctx, compute.ComputeScope)
		if err != nil {
			return nil, fmt.Errorf("application default credentials: %w; set gce.credentialsFile or GOOGLE_APPLICATION_CREDENTIALS", err)
		}
		return c, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("gce credentials file: %w", err)
	}
	c, err := google.CredentialsFromJSONWithType(ctx, b, google.ServiceAccount, compute.ComputeScope)
	if err != nil {
		return nil, fmt.Errorf("gce credentials file %s: not a usable service-account key: %w", path, err)
	}
	return c, nil
}
