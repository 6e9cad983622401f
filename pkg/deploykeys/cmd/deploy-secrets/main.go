// Command deploy-secrets generates the credentials of a deployment under
// deploy/nats (see docs/deploy.md): `make deploy-secrets DIR=... AGENTS=... GATEWAYS=...`.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"proxyfleet/pkg/deploykeys"
)

func main() {
	fs := flag.NewFlagSet("deploy-secrets", flag.ContinueOnError)
	dir := fs.String("dir", "", "output directory (created with mode 0700)")
	agents := fs.String("agents", "local/t1", "agents, comma or space separated ENTRY/TARGET, one nkey each")
	gateways := fs.String("gateways", deploykeys.DefaultGateway, "gateway names (each gateway's --name), comma or space separated, one nkey gateway-<name> each")
	hosts := fs.String("hosts", "localhost,127.0.0.1,::1", "DNS names and IP addresses of the NATS server certificate, comma separated")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	pubs, err := deploykeys.Generate(deploykeys.Options{Dir: *dir, Agents: split(*agents), Gateways: split(*gateways), Hosts: split(*hosts)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "deploy-secrets:", err)
		os.Exit(1)
	}
	fmt.Printf("wrote %d nkey seeds (<identity>.nk), %s, %s, and the CA, server and client certificates into %s\n", len(pubs), deploykeys.EnvFile, deploykeys.AccountsFile, *dir)
}

func split(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' })
}
