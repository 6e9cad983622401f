package pve_test

import (
	"encoding/pem"

	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

func pemCert(fake *pvetest.Server) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: fake.Certificate().Raw})
}
