package web

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkPoolPage10000 builds the first page of a pool of 10,000
// proxies, as GET /pools/<name> does: the page of 100 rows is found by
// binary search in the pool's sorted index, so the time does not grow
// with the pool.
func BenchmarkPoolPage10000(b *testing.B) {
	f := newFixture(b, nil)
	f.addPool("big", 10_000)
	h := f.console.Handler()
	req := httptest.NewRequest(http.MethodGet, "/pools/big", nil)
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != http.StatusOK {
			b.Fatalf("GET /pools/big: %d", w.Code)
		}
	}
}

// BenchmarkFleetPage builds the fleet page of 50 pools.
func BenchmarkFleetPage(b *testing.B) {
	f := newFixture(b, nil)
	for i := range 50 {
		f.addPool("pool-"+string(rune('a'+i%26))+string(rune('a'+i/26)), 20)
	}
	h := f.console.Handler()
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != http.StatusOK {
			b.Fatalf("GET /: %d", w.Code)
		}
	}
}
