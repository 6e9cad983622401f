package hop_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"slices"
	"testing"
	"time"

	"proxyfleet/pkg/hop"
)

// server answers the requests of one connection with the given raw
// responses, one per request, on a loopback port the kernel chose.
func server(t *testing.T, responses ...string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		br := bufio.NewReader(c)
		for _, r := range responses {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			_, _ = io.WriteString(c, r)
		}
	}()
	return ln.Addr().String()
}

func TestListedFieldsSurviveGoDroppingConnection(t *testing.T) {
	addr := server(t,
		"HTTP/1.1 200 OK\r\nConnection: X-A, keep-alive\r\nX-A: 1\r\nContent-Length: 1\r\n\r\na",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: close, X-B\r\nConnection: X-C\r\nX-B: 1\r\nX-C: 1\r\nContent-Length: 1\r\n\r\nb")
	tr := &http.Transport{DialContext: hop.Dialer((&net.Dialer{}).DialContext)}
	t.Cleanup(tr.CloseIdleConnections)
	for i, want := range [][]string{{"X-A"}, {"X-B", "X-C"}} {
		ctx, listed := hop.Track(t.Context())
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got := listed.Fields()
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if !slices.Equal(got, want) {
			t.Errorf("response %d: Connection listed %v, want %v", i, got, want)
		}
		h := resp.Header.Clone()
		hop.Remove(h, got...)
		for _, k := range want {
			if h.Get(k) != "" {
				t.Errorf("response %d: %s left after Remove", i, k)
			}
		}
	}
}

// TestListedFieldsOfAHeadSplitAcrossReads sends a response's head a few
// bytes at a time, a 100 Continue before it, so the connection must keep
// what it read of the head between reads.
func TestListedFieldsOfAHeadSplitAcrossReads(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	const resp = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Pad: 1\r\nconnection: close, X-Split\r\nX-Split: 1\r\nContent-Length: 1\r\n\r\ns"
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		for b := []byte(resp); len(b) > 0; {
			n := min(7, len(b))
			if _, err := c.Write(b[:n]); err != nil {
				return
			}
			b = b[n:]
			time.Sleep(2 * time.Millisecond) // a read each
		}
	}()
	tr := &http.Transport{DialContext: hop.Dialer((&net.Dialer{}).DialContext)}
	t.Cleanup(tr.CloseIdleConnections)
	ctx, listed := hop.Track(t.Context())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+ln.Addr().String()+"/", nil)
	r, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	got := listed.Fields()
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	if want := []string{"X-Split"}; !slices.Equal(got, want) {
		t.Errorf("Connection listed %v, want %v", got, want)
	}
}
