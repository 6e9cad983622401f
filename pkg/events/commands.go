package events

import "fmt"

// CreateCommand asks an agent to build the instance behind a proxy. It is
// carried by FLEET_CMDS only. The pool's secrets (user-data and the proxy
// password) travel in Sealed, readable only by the receiving agent; the
// planner leaves Auth.Password and UserData empty (an agent still accepts
// them, from a planner older than sealing).
type CreateCommand struct {
	ProxyID string `json:"proxyID"`
	ProxySpec
	Attempt  int        `json:"attempt"`
	Auth     *ProxyAuth `json:"auth,omitempty"`
	UserData []byte     `json:"userData,omitempty"`
	// Sealed holds a [CommandSecrets], encrypted to the agent's curve key.
	Sealed *Sealed `json:"sealed,omitempty"`
}

// CommandSecrets is the plaintext of a create command's [Sealed] box.
type CommandSecrets struct {
	// ProxyID binds the box to its command: a box copied into another
	// command does not open as that command's secrets.
	ProxyID  string `json:"proxyID"`
	Password string `json:"password,omitempty"`
	UserData []byte `json:"userData,omitempty"`
}

// Sealed is a box encrypted to one NATS curve (xkey) public key: To names
// the recipient's key, From the one-time key the sender sealed with. Only
// the holder of To's seed opens it.
type Sealed struct {
	To   string `json:"to"`
	From string `json:"from"`
	Box  []byte `json:"box"`
}

// Validate checks the command.
func (c *CreateCommand) Validate() error {
	var v ValidationError
	v.AddField(CheckIdentifier("proxyID", c.ProxyID))
	v.AddField(CheckIdentifier("pool", c.Pool))
	v.AddField(CheckIdentifier("entry", c.Entry))
	v.AddField(CheckIdentifier("target", c.Target))
	if c.Instance != InstanceName(c.ProxyID) {
		v.Add("instance", "must be the instance name derived from proxyID", c.Instance)
	}
	if c.Attempt < 1 {
		v.Add("attempt", "must be 1 or more", fmt.Sprint(c.Attempt))
	}
	if c.Port < 1 || c.Port > 65535 {
		v.Add("port", "must be between 1 and 65535", fmt.Sprint(c.Port))
	}
	if c.Egress != nil {
		// The planner copies the recorded spec's allowance.
		c.Egress.validate(&v, "egress", true)
	}
	if c.Sealed != nil && (c.Sealed.To == "" || c.Sealed.From == "" || len(c.Sealed.Box) == 0) {
		v.Add("sealed", "must name its recipient (to) and sender (from) keys and carry a box", "")
	}
	return v.Err()
}

// MsgID is the command's deterministic Nats-Msg-Id.
func (c *CreateCommand) MsgID() string { return CommandID(c.ProxyID, VerbCreate, c.Attempt) }

// DeleteCommand asks an agent to remove the instance behind a proxy.
type DeleteCommand struct {
	ProxyID    string `json:"proxyID"`
	Pool       string `json:"pool"`
	Entry      string `json:"entry"`
	Target     string `json:"target"`
	Instance   string `json:"instance"`
	ProviderID string `json:"providerID,omitempty"`
	Attempt    int    `json:"attempt"`
	Reason     string `json:"reason,omitempty"`
}

// Validate checks the command.
func (c *DeleteCommand) Validate() error {
	var v ValidationError
	v.AddField(CheckIdentifier("proxyID", c.ProxyID))
	v.AddField(CheckIdentifier("entry", c.Entry))
	v.AddField(CheckIdentifier("target", c.Target))
	if c.Instance != InstanceName(c.ProxyID) {
		v.Add("instance", "must be the instance name derived from proxyID", c.Instance)
	}
	if c.Attempt < 1 {
		v.Add("attempt", "must be 1 or more", fmt.Sprint(c.Attempt))
	}
	return v.Err()
}

// MsgID is the command's deterministic Nats-Msg-Id.
func (c *DeleteCommand) MsgID() string { return CommandID(c.ProxyID, VerbDelete, c.Attempt) }

// CommandID returns "<proxy>.<verb>.<attempt>", the Nats-Msg-Id of a command.
func CommandID(proxyID, verb string, attempt int) string {
	return fmt.Sprintf("%s.%s.%d", proxyID, verb, attempt)
}
