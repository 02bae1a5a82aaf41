package cli

import (
	"context"
	"errors"
	"flag"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/ferry-dev/ferry/agenttools/mcptools"
)

func mcpFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o MCP
	fs.BoolVar(&o.Migrate, "migrate", false, "apply pending migrations at start instead of refusing to start")
	return func(ctx context.Context, _ []string) error { return o.Run(ctx, env) }
}

// MCP is `mcp`: the application's agent tools over MCP on env's standard
// input and output, for a host that starts the binary as a subprocess.
type MCP struct {
	// Migrate applies pending migrations at start instead of refusing.
	Migrate bool
}

// Run serves until the host closes standard input or ctx ends.
func (o MCP) Run(ctx context.Context, env *Env) error {
	// stdout is the protocol's: every log line goes to stderr. The tools
	// only write intents, so no broker connection.
	a, logger, err := env.newApp(ctx, o.Migrate, env.Stderr, true, nil)
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
