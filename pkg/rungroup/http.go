package rungroup

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"
)

// HTTP is a member that serves srv on ln. Its stop shuts srv down
// gracefully: ln closes at once, requests in flight get up to grace to
// finish, and the connections left then are closed.
func HTTP(name string, srv *http.Server, ln net.Listener, grace time.Duration) Member {
	return Member{
		Name: name,
		Run: func(context.Context) error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		},
		Stop: func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, grace)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				_ = srv.Close()
				return err
			}
			return nil
		},
	}
}
