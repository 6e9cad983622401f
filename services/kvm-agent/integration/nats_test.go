//go:build integration || e2e

package integration

import "github.com/nats-io/nats.go"

type natsMsg = nats.Msg
