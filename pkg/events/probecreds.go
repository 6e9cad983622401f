package events

// The fleet-probe-creds bucket gives the health service the password each
// pool's proxies are probed with, without health reading fleet-secrets:
// health announces its curve (xkey) public key under [ProbeRecipientKey];
// the planner writes, under each pool's name, a [ProbeCredential] whose
// box holds a [ProbeSecret] sealed to that key.

// ProbeRecipientKey is the fleet-probe-creds key where health announces
// its curve public key. Pool names cannot start with '_'.
const ProbeRecipientKey = "_recipient"

// ProbeCredential is one pool's fleet-probe-creds value.
type ProbeCredential struct {
	// Revision is the revision of the pool's secrets it was sealed from.
	Revision int    `json:"revision"`
	Sealed   Sealed `json:"sealed"`
}

// ProbeSecret is the plaintext of a [ProbeCredential]'s box.
type ProbeSecret struct {
	// Pool binds the box to its key: a box copied under another pool's
	// name does not open as that pool's password.
	Pool     string `json:"pool"`
	Password string `json:"password"`
	// External holds an external pool's credentials by proxy address
	// ("host:port"); its proxies are used with them instead of Password.
	External map[string]ProxyAuth `json:"external,omitempty"`
}
