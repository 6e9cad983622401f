//go:build integration

package integration

import "github.com/nats-io/nats.go"

type natsMsg = nats.Msg
