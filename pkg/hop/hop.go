// Package hop removes the hop-by-hop header fields a proxy must not relay
// (RFC 9110 section 7.6.1): the fixed ones, and every field the Connection
// header lists.
//
// Go's HTTP client drops a response's whole Connection header when it
// holds "close", so a response's "Connection: close, X-Foo" reaches the
// caller as a header without Connection and with X-Foo, which nothing can
// then tell from an end-to-end field. [Dialer] and [Track] keep what the
// Connection header listed: connections opened by a dial function
// [Dialer] wraps note the Connection fields of each response they carry,
// and a request whose context went through [Track] finds them on the
// [Listed] it returns once the response arrived.
package hop

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
)

// Fixed are the header fields that are hop-by-hop whatever the Connection
// header says.
var Fixed = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// Remove deletes from h the fields its Connection header lists, the
// fields listed names (a response's Connection list kept by [Listed]),
// and the [Fixed] fields.
func Remove(h http.Header, listed ...string) {
	for _, f := range h.Values("Connection") {
		for _, k := range strings.Split(f, ",") {
			if k = strings.TrimSpace(k); k != "" {
				h.Del(k)
			}
		}
	}
	for _, k := range listed {
		h.Del(k)
	}
	for _, k := range Fixed {
		h.Del(k)
	}
}

// maxHead is the most of a response's head a connection keeps while it
// looks for the Connection header; past it the fields are not noted.
const maxHead = 64 << 10

// Dialer wraps dial so that the connections it opens note the Connection
// header fields of the responses read from them.
func Dialer(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &conn{Conn: c}, nil
	}
}

// conn reads the head of each response: from [conn.arm] (the transport
// chose it for a request, whose response is the next thing it reads) to
// the end of the first final (not 1xx) response's header.
type conn struct {
	net.Conn
	mu     sync.Mutex
	armed  bool
	head   []byte
	listed []string
	done   bool
}

func (c *conn) arm() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed, c.done, c.head, c.listed = true, false, c.head[:0], nil
}

func (c *conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		if c.armed && !c.done {
			c.scan(p[:n])
		}
		c.mu.Unlock()
	}
	return n, err
}

// scan adds b to the head read so far and, once a final response's header
// is complete, notes its Connection fields. A head that arrives whole in
// one read (the usual case) is scanned where it lies, uncopied.
func (c *conn) scan(b []byte) {
	data, kept := b, len(c.head) > 0
	if kept {
		c.head = append(c.head, b...)
		data = c.head
	}
	for {
		end, size := headEnd(data)
		if end < 0 {
			switch {
			case len(data) > maxHead:
				c.done, c.head = true, nil
			case kept:
				c.head = data
			default:
				c.head = append(c.head[:0], data...)
			}
			return
		}
		block := data[:end]
		if informational(block) {
			data = data[end+size:]
			continue
		}
		c.listed = connectionFields(block)
		c.done, c.head = true, c.head[:0]
		return
	}
}

// headEnd returns where the blank line ending a header block starts and
// its length, or -1.
func headEnd(b []byte) (int, int) {
	if i := bytes.Index(b, []byte("\r\n\r\n")); i >= 0 {
		return i, 4
	}
	if i := bytes.Index(b, []byte("\n\n")); i >= 0 {
		return i, 2
	}
	return -1, 0
}

// informational reports whether a header block is a 1xx response other
// than 101, which a final response follows on the same connection.
func informational(block []byte) bool {
	line, _, _ := bytes.Cut(block, []byte("\n"))
	_, rest, _ := bytes.Cut(line, []byte(" "))
	return len(rest) >= 3 && rest[0] == '1' && !bytes.HasPrefix(rest, []byte("101"))
}

// connectionFields returns the field names the Connection lines of a
// header block list, "close" and "keep-alive" left out.
func connectionFields(block []byte) []string {
	var out []string
	_, lines, _ := bytes.Cut(block, []byte("\n")) // past the status line
	for len(lines) > 0 {
		var l []byte
		l, lines, _ = bytes.Cut(lines, []byte("\n"))
		name, value, ok := bytes.Cut(bytes.TrimRight(l, "\r"), []byte(":"))
		if !ok || !bytes.EqualFold(name, []byte("Connection")) {
			continue
		}
		for k := range strings.SplitSeq(string(value), ",") {
			k = strings.TrimSpace(k)
			if k != "" && !strings.EqualFold(k, "close") && !strings.EqualFold(k, "keep-alive") {
				out = append(out, k)
			}
		}
	}
	return out
}

// Listed holds what the Connection header of one request's response
// listed.
type Listed struct {
	mu sync.Mutex
	c  *conn
}

// Track returns ctx with a trace that finds the connection the request
// goes out on, and the [Listed] to ask once the response arrived. It
// finds nothing on a connection [Dialer] did not open, or one the
// transport wrapped in TLS: the fields are then unknown.
func Track(ctx context.Context) (context.Context, *Listed) {
	l := &Listed{}
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			c, ok := info.Conn.(*conn)
			if !ok {
				return
			}
			c.arm()
			l.mu.Lock()
			l.c = c
			l.mu.Unlock()
		},
	}), l
}

// Fields returns the fields the Connection header of the response listed,
// beside "close" and "keep-alive". Call it once the response's header has
// arrived, before its body is read to the end (the connection may carry
// the next request then).
func (l *Listed) Fields() []string {
	l.mu.Lock()
	c := l.c
	l.mu.Unlock()
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.done {
		return nil
	}
	return c.listed
}
