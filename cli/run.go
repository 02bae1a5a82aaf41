package cli

import (
	"context"
	"flag"
	"io"
	"log/slog"

	"github.com/ferry-dev/ferry/app"
)

func serveFlags(what app.Components) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		migrate := fs.Bool("migrate", false, "apply pending migrations at start instead of refusing to start")
		var mode *string
		if what.Relay {
			mode = fs.String("mode", "", "relay mode: notify, poll or cdc (stream the outbox from the WAL); overrides FERRY_RELAY_MODE")
		}
		return func(ctx context.Context, _ []string) error {
			o := Serve{What: what, Migrate: *migrate}
			if mode != nil {
				o.Mode = *mode
			}
			return o.Run(ctx, env)
		}
	}
}

// Serve is `run`, `serve`, `relay` and `consume`: the application's
// components What (from env's options and the FERRY_* configuration) until
// ctx ends.
type Serve struct {
	What app.Components
	// Migrate applies pending migrations at start instead of refusing.
	Migrate bool
	// Mode overrides FERRY_RELAY_MODE (notify, poll or cdc) when set.
	Mode string
}

// Run starts the components and runs them until ctx ends.
func (o Serve) Run(ctx context.Context, env *Env) error {
	var set func(*app.Config)
	if o.Mode != "" {
		switch o.Mode {
		case app.RelayModeNotify, app.RelayModePoll, app.RelayModeCDC:
		default:
			return usagef("--mode must be %s, %s or %s, got %q", app.RelayModeNotify, app.RelayModePoll, app.RelayModeCDC, o.Mode)
		}
		set = func(c *app.Config) { c.RelayMode = o.Mode }
	}
	// The producers' side needs no broker: orders are taken (into the
	// outbox) while it is down, as the outbox promises.
	withoutBroker := !o.What.Relay && !o.What.Consumers
	a, logger, err := env.newApp(ctx, o.Migrate, nil, withoutBroker, set)
	if err != nil {
		return err
	}
	defer a.Close()
	logger.Info(env.Name+" started", "components", o.What, "version", env.Options.Version)
	return a.Run(ctx, o.What, nil)
}

// newApp builds the application from the FERRY_* configuration and the
// binary's options, logging to logTo (nil: standard error).
func (e *Env) newApp(ctx context.Context, migrate bool, logTo io.Writer, withoutBroker bool, set func(*app.Config)) (*app.App, *slog.Logger, error) {
	cfg, err := LoadConfig()
	if err != nil {
		return nil, nil, err
	}
	if set != nil {
		set(&cfg)
	}
	logger, err := app.NewLogger(cfg, logTo)
	if err != nil {
		return nil, nil, err
	}
	opts, err := e.appOptions()
	if err != nil {
		return nil, nil, err
	}
	opts.Migrate = opts.Migrate || migrate
	opts.Logger, opts.Version = logger, e.Options.Version
	opts.WithoutBroker = opts.WithoutBroker || withoutBroker
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		return nil, nil, err
	}
	return a, logger, nil
}
