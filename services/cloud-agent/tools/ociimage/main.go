// Command ociimage writes a single-layer OCI image-layout tar from a
// root filesystem tar, the form `ctr images import` (and skopeo, podman,
// crane) read, so the Kubernetes node tier runs a locally built Squid
// image without a registry:
//
//	ociimage -layer rootfs.tar -name localhost/proxyfleet/squid:TAG -o squid-oci.tar
//
// The layer is stored uncompressed; its digest is its diff ID.
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
)

func main() {
	var o options
	fs := flag.NewFlagSet("ociimage", flag.ExitOnError)
	fs.StringVar(&o.layer, "layer", "", "root filesystem tar (the image's only layer)")
	fs.StringVar(&o.name, "name", "", "image reference, e.g. localhost/proxyfleet/squid:5.7-1")
	fs.StringVar(&o.out, "o", "", "where to write the OCI image-layout tar")
	entry := fs.String("entrypoint", "", "entrypoint, space separated (none when empty)")
	cmd := fs.String("cmd", "", "command, space separated (none when empty)")
	fs.StringVar(&o.user, "user", "", "user the image runs as (uid[:gid]), empty for root")
	fs.StringVar(&o.arch, "arch", runtime.GOARCH, "architecture of the image")
	_ = fs.Parse(os.Args[1:])
	if o.layer == "" || o.name == "" || o.out == "" || fs.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: ociimage -layer rootfs.tar -name REF -o image.tar [-entrypoint CMD] [-cmd CMD] [-user UID]")
		os.Exit(2)
	}
	o.entrypoint, o.cmd = strings.Fields(*entry), strings.Fields(*cmd)
	if err := write(o); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		os.Exit(1)
	}
}
