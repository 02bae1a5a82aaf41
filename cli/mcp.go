package cli

import (
	"context"
	"errors"
	"flag"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/ferry-dev/ferry/agenttools/mcptools"
)

func mcpFlags(fs *flag.FlagSet, env *Env) RunFunc {
	migrate := fs.Bool("migrate", false, "apply pending migrations at start instead of refusing to start")
	return func(ctx context.Context, _ []string) error {
		// stdout is the protocol's: every log line goes to stderr. The tools
		// only write intents, so no broker connection.
		a, logger, err := env.newApp(ctx, *migrate, env.Stderr, true, nil)
		if err != nil {
			return err
		}
		defer a.Close()
		if a.Tools() == nil {
			return errors.New("this application defines no agent tools (app.Options.Tools)")
		}
		logger.Info(env.Name+" mcp serving on stdio", "tools", len(a.Tools().Tools()))
		return mcptools.ServeStdio(ctx, a.Tools(), &mcp.Implementation{Name: env.Name, Version: env.Options.Version}, logger)
	}
}
