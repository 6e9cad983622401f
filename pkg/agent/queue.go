package agent

import "sync"

// keyedQueue runs functions one at a time per key and concurrently across
// keys: commands for one proxy are handled in the order they arrived, while
// one slow proxy never holds up another.
type keyedQueue struct {
	mu      sync.Mutex
	pending map[string][]func()
	wg      sync.WaitGroup
}

func newKeyedQueue() *keyedQueue { return &keyedQueue{pending: map[string][]func(){}} }

// Submit queues fn behind earlier functions of key.
func (q *keyedQueue) Submit(key string, fn func()) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if list, busy := q.pending[key]; busy {
		q.pending[key] = append(list, fn)
		return
	}
	q.pending[key] = nil
	q.wg.Add(1)
	go q.run(key, fn)
}

func (q *keyedQueue) run(key string, fn func()) {
	defer q.wg.Done()
	for {
		fn()
		q.mu.Lock()
		list := q.pending[key]
		if len(list) == 0 {
			delete(q.pending, key)
			q.mu.Unlock()
			return
		}
		fn = list[0]
		q.pending[key] = list[1:]
		q.mu.Unlock()
	}
}

// Busy reports whether a function of key is running or waiting.
func (q *keyedQueue) Busy(key string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	_, busy := q.pending[key]
	return busy
}

// Wait blocks until every submitted function has returned.
func (q *keyedQueue) Wait() { q.wg.Wait() }
