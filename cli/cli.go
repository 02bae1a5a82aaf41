// Package cli is Ferry's command line as a library: a table of commands
// (name, summary, flags, run) from which the help is generated, so that
// `ferry help`, `ferry <command> -h` and the commands themselves never
// drift. A service embeds the operations commands (run, relay, consume,
// migrate, status, poison, prune, healthcheck) in its own binary with its
// own route table:
//
//	func main() {
//		cli.Main(cli.Options{
//			Name: "invoices",
//			App:  func() (app.Options, error) { return invoices.Options(), nil },
//		})
//	}
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/migrations"
)

// RunFunc runs a command with its flags parsed; args are what follows them.
type RunFunc func(ctx context.Context, args []string) error

// Command is one entry of the table.
type Command struct {
	// Name is the word that selects the command.
	Name string
	// Args is the synopsis of the positional arguments, if any.
	Args string
	// Summary is the one-line description shown in `help`.
	Summary string
	// Long, if set, is shown by `<command> -h` under the summary.
	Long string
	// Flags declares the command's flags on fs and returns the function
	// that runs it with them. Nil for a command with sub-commands only.
	Flags func(fs *flag.FlagSet, env *Env) RunFunc
	// Sub are sub-commands ("poison list"): the first argument selects one.
	Sub []*Command
}

// Env is what commands run with.
type Env struct {
	// Name is the binary's name in messages and help.
	Name           string
	Stdout, Stderr io.Writer
	Options        Options
}

// Options configure the CLI of a binary.
type Options struct {
	// Name is the binary's name. Default "ferry".
	Name string
	// Description is the first line of `help`.
	Description string
	// Version is printed by `version` and reported in `status`. Default "dev".
	Version string
	// App returns the application's options (its route table, chain,
	// migrations, HTTP API): run, relay and consume build the app with
	// them; migrate uses their migration sets. Required for those commands.
	App func() (app.Options, error)
	// EnvVars are the application's own variables, listed by `help config`.
	EnvVars []app.EnvVar
	// Commands are added to Ferry's (demo, sandbox, bench in cmd/ferry).
	Commands []*Command
}

// CLI is a command table with its help.
type CLI struct {
	env      Env
	commands []*Command
}

// New returns the CLI with Ferry's commands and opts.Commands.
func New(opts Options) *CLI {
	if opts.Name == "" {
		opts.Name = "ferry"
	}
	if opts.Version == "" {
		opts.Version = "dev"
	}
	// The help starts "<name>: <description>": a description that names
	// the binary itself ("signups: …", as Go doc comments do) would say it
	// twice.
	opts.Description = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(opts.Description), opts.Name+":"))
	if opts.Description == "" {
		opts.Description = "a transactional-outbox event pipeline (PostgreSQL → RabbitMQ → idempotent consumers)"
	}
	c := &CLI{env: Env{Name: opts.Name, Options: opts}}
	c.commands = append(Commands(), opts.Commands...)
	c.commands = append(c.commands,
		&Command{Name: "help", Args: "[config | <command>]", Summary: "show this help, the configuration variables, or a command's flags", Flags: c.helpCommand},
		&Command{Name: "version", Summary: "print the version", Flags: func(_ *flag.FlagSet, env *Env) RunFunc {
			return func(context.Context, []string) error {
				fmt.Fprintln(env.Stdout, env.Name, env.Options.Version)
				return nil
			}
		}},
	)
	return c
}

// Main runs the CLI on os.Args and exits with its status: 0 done, 1 failed,
// 2 bad usage, 3 `status` found something that needs a human.
func Main(opts Options) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := New(opts).Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Commands returns Ferry's own commands: the operations a service embeds.
func Commands() []*Command {
	return []*Command{
		cmdRun, cmdServe, cmdRelay, cmdConsume, cmdMCP, cmdMigrate, cmdStatus, cmdPoison, cmdOutbox, cmdPrune, cmdShadow, cmdBackfill, cmdFind, cmdPause, cmdResume, cmdHeld, cmdTenants, cmdAudit, cmdCDC, cmdSchema, cmdHealthcheck,
	}
}

// UsageError marks an error as bad usage (exit status 2).
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

func usagef(format string, a ...any) error { return UsageError{fmt.Errorf(format, a...)} }

// ExitError ends a command with Code, printing Err (if any) like any error.
type ExitError struct {
	Code int
	Err  error
}

func (e ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}
func (e ExitError) Unwrap() error { return e.Err }

// binaryName is the running CLI's name (Options.Name), for the hints that
// name a command to run: an embedding binary's hints name itself. One CLI
// runs per process, so a package variable set by Run serves every message.
var binaryName = "ferry"

// Run runs the command that args select and returns the exit status.
func (c *CLI) Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c.env.Stdout, c.env.Stderr = stdout, stderr
	binaryName = c.env.Name
	if len(args) == 0 {
		c.printUsage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "--help":
		c.printUsage(stdout)
		return 0
	case "--version":
		args = []string{"version"}
	}
	path, cmd, rest, err := c.find(args)
	if err == nil {
		err = c.runCommand(ctx, path, cmd, rest)
	}
	name := strings.Join(append([]string{c.env.Name}, path...), " ")
	var usage UsageError
	var exit ExitError
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &exit):
		if exit.Err != nil {
			fmt.Fprintf(stderr, "%s: %s%s\n", name, oneLine(exit.Err), hint(exit.Err))
		}
		return exit.Code
	case errors.As(err, &usage):
		fmt.Fprintf(stderr, "%s: %s\n(see %s -h)\n", name, oneLine(err), name)
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "%s: %s%s\n", name, oneLine(err), hint(err))
		return 1
	}
	return 0
}

// find walks args down the table to a runnable command.
func (c *CLI) find(args []string) (path []string, cmd *Command, rest []string, err error) {
	list := c.commands
	for {
		i := slices.IndexFunc(list, func(x *Command) bool { return x.Name == args[0] })
		if i < 0 {
			if cmd == nil {
				return path, nil, nil, usagef("unknown command %q", args[0])
			}
			return path, cmd, nil, usagef("unknown %s command %q: want %s", cmd.Name, args[0], names(cmd.Sub))
		}
		cmd, args, path = list[i], args[1:], append(path, list[i].Name)
		if len(cmd.Sub) == 0 {
			return path, cmd, args, nil
		}
		if len(args) == 0 {
			return path, cmd, nil, usagef("want one of: %s", names(cmd.Sub))
		}
		if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
			c.printCommandHelp(c.env.Stdout, path, cmd)
			return path, cmd, nil, flag.ErrHelp
		}
		list = cmd.Sub
	}
}

func names(cmds []*Command) string {
	n := make([]string, len(cmds))
	for i, c := range cmds {
		n[i] = c.Name
	}
	return strings.Join(n, ", ")
}

func (c *CLI) flagSet(path []string, cmd *Command) (*flag.FlagSet, RunFunc) {
	fs := flag.NewFlagSet(strings.Join(path, " "), flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var run RunFunc
	if cmd.Flags != nil {
		run = cmd.Flags(fs, &c.env)
	}
	return fs, run
}

func (c *CLI) runCommand(ctx context.Context, path []string, cmd *Command, args []string) error {
	fs, run := c.flagSet(path, cmd)
	positional, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			c.printCommandHelp(c.env.Stdout, path, cmd)
			return err
		}
		return UsageError{err}
	}
	if cmd.Args == "" && len(positional) > 0 {
		return usagef("unexpected argument %q", positional[0])
	}
	if cmd.Name != "help" && cmd.Name != "version" {
		for _, w := range app.UnknownVariables(os.Environ(), c.env.Options.EnvVars) {
			fmt.Fprintf(c.env.Stderr, "%s: warning: %s\n", c.env.Name, w)
		}
	}
	return run(ctx, positional)
}

// parseInterspersed parses flags anywhere among the arguments, before and
// after the positional ones, as the docs write command lines ("ferry pause
// payments.charge --reason …"): the standard flag package stops at the
// first argument that is not a flag, and the flags after it were taken
// for arguments. "--" ends the flags: what follows is positional, even if
// it starts with "-".
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional, args = append(positional, rest[0]), rest[1:]
	}
}

// synopsis is the command line of cmd: its name, flags and arguments.
func (c *CLI) synopsis(path []string, cmd *Command) string {
	var b strings.Builder
	b.WriteString(strings.Join(path, " "))
	if len(cmd.Sub) > 0 {
		b.WriteString(" <" + strings.ReplaceAll(names(cmd.Sub), ", ", "|") + ">")
		return b.String()
	}
	fs, _ := c.flagSet(path, cmd)
	fs.VisitAll(func(f *flag.Flag) {
		b.WriteString(" [--" + f.Name)
		if name, _ := flag.UnquoteUsage(f); name != "" {
			b.WriteString(" " + name)
		}
		b.WriteString("]")
	})
	if cmd.Args != "" {
		b.WriteString(" " + cmd.Args)
	}
	return b.String()
}

func (c *CLI) printUsage(w io.Writer) {
	fmt.Fprintf(w, "%s: %s\n\nUsage:\n  %s <command> [flags]\n\nCommands:\n", c.env.Name, c.env.Options.Description, c.env.Name)
	for _, cmd := range c.commands {
		c.printEntry(w, []string{cmd.Name}, cmd)
	}
	fmt.Fprintf(w, "\n%s <command> -h shows a command's flags. Configuration is read from FERRY_* environment\nvariables: see \"%s help config\".\n", c.env.Name, c.env.Name)
}

func (c *CLI) printEntry(w io.Writer, path []string, cmd *Command) {
	if len(cmd.Sub) > 0 {
		for _, s := range cmd.Sub {
			c.printEntry(w, append(slices.Clone(path), s.Name), s)
		}
		return
	}
	fmt.Fprintf(w, "  %s\n      %s\n", c.synopsis(path, cmd), cmd.Summary)
}

func (c *CLI) printCommandHelp(w io.Writer, path []string, cmd *Command) {
	full := append([]string{c.env.Name}, path...)
	fmt.Fprintf(w, "%s: %s\n", strings.Join(full, " "), cmd.Summary)
	if cmd.Long != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimSpace(cmd.Long))
	}
	if len(cmd.Sub) > 0 {
		fmt.Fprintf(w, "\nUsage:\n")
		for _, s := range cmd.Sub {
			fmt.Fprintf(w, "  %s %s\n      %s\n", c.env.Name, c.synopsis(append(slices.Clone(path), s.Name), s), s.Summary)
		}
		return
	}
	fmt.Fprintf(w, "\nUsage:\n  %s %s\n", c.env.Name, c.synopsis(path, cmd))
	fs, _ := c.flagSet(path, cmd)
	has := false
	fs.VisitAll(func(*flag.Flag) { has = true })
	if has {
		fmt.Fprintf(w, "\nFlags:\n")
		fs.SetOutput(w)
		fs.PrintDefaults()
	}
}

func (c *CLI) helpCommand(_ *flag.FlagSet, env *Env) RunFunc {
	return func(_ context.Context, args []string) error {
		switch {
		case len(args) == 0:
			c.printUsage(env.Stdout)
		case args[0] == "config":
			printConfigHelp(env.Stdout, env.Options.EnvVars)
		default:
			// "-h" after the words: a command with sub-commands prints its
			// help in find, a leaf is printed here.
			path, cmd, _, err := c.find(append(slices.Clone(args), "-h"))
			if errors.Is(err, flag.ErrHelp) {
				return nil
			}
			if err != nil {
				return err
			}
			c.printCommandHelp(env.Stdout, path, cmd)
		}
		return nil
	}
}

// WriteConfigReference writes the configuration reference as Markdown:
// Ferry's variables (app.EnvVars), then the binary's own (extra), from the
// same table `help config` prints. docs/configuration.md is its output for
// the ferry binary.
func WriteConfigReference(w io.Writer, name string, extra []app.EnvVar) error {
	cell := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
	table := func(vars []app.EnvVar) {
		fmt.Fprintln(w, "| variable | default | what it sets |")
		fmt.Fprintln(w, "|---|---|---|")
		for _, ev := range vars {
			fmt.Fprintf(w, "| `%s` | %s | %s |\n", ev.Name, cell(ev.Default), cell(ev.Doc))
		}
	}
	fmt.Fprintf(w, "# Configuration\n\n<!-- Generated from app.EnvVars and the %s binary's own variables: edit those, then run\n     `go test ./cmd/ferry/ -run TestConfigurationReference -update`. -->\n\n", name)
	fmt.Fprintf(w, "Every variable is read at start (`app.ConfigFromEnv`), validated with the others, and\nreported by name when wrong. `%s help config` prints the same list.\n\n", name)
	fmt.Fprintln(w, "## Ferry")
	fmt.Fprintln(w)
	table(app.EnvVars())
	if len(extra) > 0 {
		fmt.Fprintf(w, "\n## The %s binary\n\n", name)
		table(extra)
	}
	return nil
}

func printConfigHelp(w io.Writer, extra []app.EnvVar) {
	fmt.Fprintln(w, "Configuration (environment variables; defaults in brackets):")
	for _, ev := range append(app.EnvVars(), extra...) {
		fmt.Fprintf(w, "  %-30s %s [%s]\n", ev.Name, ev.Doc, ev.Default)
	}
}

// oneLine is err on one line, every control or formatting character
// escaped (display.Escape): an error can quote input (a URL, a header, a
// topic) holding escape sequences that would otherwise drive the terminal.
func oneLine(err error) string {
	fields := strings.FieldsFunc(err.Error(), func(r rune) bool { return r == '\n' || r == '\r' || r == '\t' })
	return display.Escape(strings.Join(fields, "; "), 0, false)
}

// hint says what to do about the errors an operator meets first. It goes
// by the server's error codes where there are some: a missing database is
// not a stopped server.
func hint(err error) string {
	if errors.Is(err, app.ErrMigrationsPending) {
		return " (run `" + binaryName + " migrate up`, or start with --migrate)"
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "3D000":
			return " (the database does not exist: create it, e.g. createdb, or fix the database name in FERRY_DATABASE_URL)"
		case "28P01", "28000":
			return " (check the user, password and database in FERRY_DATABASE_URL)"
		}
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "PostgreSQL") && (strings.Contains(msg, "password authentication failed") || strings.Contains(msg, "does not exist")):
		return " (check the user, password and database in FERRY_DATABASE_URL)"
	case strings.Contains(msg, "cannot reach PostgreSQL"):
		return " (is PostgreSQL running? start it, or check the host and port: check FERRY_DATABASE_URL)"
	case strings.Contains(msg, "RabbitMQ") && (strings.Contains(msg, "403") || strings.Contains(msg, "not allowed")):
		return " (check the user, password and vhost in FERRY_AMQP_URL)"
	case strings.Contains(msg, "connecting to RabbitMQ"):
		return " (is RabbitMQ running? check FERRY_AMQP_URL)"
	}
	return ""
}

// LoadConfig reads app.Config from the FERRY_* variables.
func LoadConfig() (app.Config, error) {
	cfg, err := app.ConfigFromEnv()
	if err != nil {
		return cfg, fmt.Errorf("invalid configuration: %w", err)
	}
	return cfg, nil
}

// appOptions are the application's options, or an error saying that this
// binary has no application to run.
func (e *Env) appOptions() (app.Options, error) {
	if e.Options.App == nil {
		return app.Options{}, errors.New("this binary has no route table (cli.Options.App)")
	}
	return e.Options.App()
}

// migrationSets are Ferry's and the application's migration sets.
func (e *Env) migrationSets() ([]migrations.Set, error) {
	if e.Options.App == nil {
		return app.MigrationSets(app.Options{})
	}
	o, err := e.Options.App()
	if err != nil {
		return nil, err
	}
	return app.MigrationSets(o)
}
