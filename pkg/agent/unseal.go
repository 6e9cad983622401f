package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

// KeyFile is the seed file of the key of the agent serving entry and
// target, inside dir: "<dir>/<entry>.<target>.xk".
func KeyFile(dir, entry, target string) string {
	return filepath.Join(dir, HeartbeatKey(entry, target)+".xk")
}

// agentKey returns the runtime's curve key: cfg.Key, the one in cfg.KeyDir
// (made on first start), or a new one held in memory.
func agentKey(cfg Config) (nkeys.KeyPair, error) {
	if cfg.Key != nil {
		if err := seal.CheckPublic(seal.Public(cfg.Key)); err != nil {
			return nil, fmt.Errorf("agent key: %w", err)
		}
		return cfg.Key, nil
	}
	if cfg.KeyDir == "" {
		return seal.NewKey()
	}
	kp, err := seal.LoadOrCreate(KeyFile(cfg.KeyDir, cfg.Info.Entry, cfg.Info.Target))
	if err != nil {
		return nil, fmt.Errorf("agent key: %w", err)
	}
	return kp, nil
}

// unseal opens the command's sealed secrets into Auth.Password and
// UserData, before the driver sees them. A box that does not open with
// this agent's key is a permanent failure: retrying cannot open it. The
// error names the keys, never the box or its content.
func (r *Runtime) unseal(cmd *events.CreateCommand) error {
	if cmd.Sealed == nil {
		return nil
	}
	plain, err := seal.Open(r.key, cmd.Sealed)
	if errors.Is(err, seal.ErrWrongKey) {
		return Wrap(ErrPermanent, fmt.Errorf("the create command's secrets are %w (this agent's key changed since the planner sealed them: its heartbeat now announces the new key, and the replacement proxy's command will be sealed to it)", err))
	}
	if err != nil {
		return Wrap(ErrPermanent, fmt.Errorf("the create command's secrets: %w", err))
	}
	var sec events.CommandSecrets
	if err := json.Unmarshal(plain, &sec); err != nil {
		return Wrap(ErrPermanent, errors.New("the create command's secrets opened but do not decode"))
	}
	if sec.ProxyID != cmd.ProxyID {
		return Wrap(ErrPermanent, fmt.Errorf("the create command's secrets were sealed for proxy %q, not %q", sec.ProxyID, cmd.ProxyID))
	}
	if sec.Password != "" {
		if cmd.Auth == nil {
			return Wrap(ErrPermanent, errors.New("the create command's secrets hold a password but the command names no username"))
		}
		auth := *cmd.Auth
		auth.Password = sec.Password
		cmd.Auth = &auth
	}
	if len(sec.UserData) > 0 {
		cmd.UserData = sec.UserData
	}
	cmd.Sealed = nil
	return nil
}
