// Command fwdproxy is the tiny forward proxy of the boot test's guest: plain
// HTTP (absolute-form requests) and CONNECT tunnels, no auth, no cache.
package main

import (
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"time"
)

func main() {
	listen := flag.String("listen", ":3128", "address to listen on")
	flag.Parse()
	tr := &http.Transport{Proxy: nil, DialContext: (&net.Dialer{Timeout: 10 * time.Second}).DialContext}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect {
			up, err := net.DialTimeout("tcp", r.Host, 10*time.Second)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			hj, ok := w.(http.Hijacker)
			if !ok {
				up.Close()
				return
			}
			c, rw, err := hj.Hijack()
			if err != nil {
				up.Close()
				return
			}
			_, _ = rw.WriteString("HTTP/1.1 200 Connection established\r\n\r\n")
			_ = rw.Flush()
			go func() { _, _ = io.Copy(up, rw); up.Close() }()
			_, _ = io.Copy(c, up)
			c.Close()
			return
		}
		if !r.URL.IsAbs() {
			http.Error(w, "proxy requests only", http.StatusBadRequest)
			return
		}
		r.RequestURI = ""
		r.Header.Del("Proxy-Connection")
		resp, err := tr.RoundTrip(r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		for k, vs := range resp.Header {
			for _, v := range vs {
				w.Header().Add(k, v)
			}
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	})
	log.Printf("fwdproxy listening on %s", *listen)
	log.Fatal(http.ListenAndServe(*listen, h))
}
