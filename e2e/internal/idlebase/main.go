// Command idlebase is the baseline of the idle-memory benchmark
// (BenchmarkIdleRSS): a Go program that does what every proxyfleet service
// does at idle with nothing else linked. It connects to NATS with nats.go
// and JetStream and puts a heartbeat into a key-value bucket every
// interval, as an agent does, until SIGINT or SIGTERM.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func main() {
	url := flag.String("nats-url", "", "NATS server URL")
	bucket := flag.String("bucket", "", "key-value bucket of the heartbeats")
	key := flag.String("key", "", "key of this program's heartbeat")
	interval := flag.Duration("interval", 5*time.Second, "time between two heartbeats")
	flag.Parse()
	if err := run(*url, *bucket, *key, *interval); err != nil {
		fmt.Fprintln(os.Stderr, "idlebase:", err)
		os.Exit(1)
	}
}

func run(url, bucket, key string, interval time.Duration) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	nc, err := nats.Connect(url, nats.Name("idlebase"), nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return fmt.Errorf("bucket %s: %w", bucket, err)
	}
	start := time.Now().UTC()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		b, _ := json.Marshal(map[string]any{"startedAt": start, "at": time.Now().UTC()})
		if _, err := kv.Put(ctx, key, b); err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "idlebase: heartbeat:", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
