package bustest

import (
	"sync"
	"testing"
)

// Rewriters calls write for each of keys over and over, each key from a
// goroutine of its own, until the returned stop is called; stop waits for
// them, and the test's end calls it too. A failed write fails the test and
// ends its goroutine. Tests use it to keep a bucket's keys being rewritten
// while they read the bucket.
func Rewriters(t testing.TB, keys []string, write func(key string) error) (stop func()) {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	stop = sync.OnceFunc(func() { close(done); wg.Wait() })
	t.Cleanup(stop)
	for _, k := range keys {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				if err := write(k); err != nil {
					t.Errorf("rewrite %s: %v", k, err)
					return
				}
			}
		})
	}
	return stop
}
