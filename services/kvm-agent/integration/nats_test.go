//go:build integration || e2e || bench

package integration

import "github.com/nats-io/nats.go"

type natsMsg = nats.Msg
