package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/ferry-dev/ferry/evolve"
)

// DefaultSchemaFile is where `schema check --write` records the snapshot.
const DefaultSchemaFile = "ferry-schemas.json"

var cmdSchema = &Command{Name: "schema", Summary: "event types and their versions (app.Options.Events)", Sub: []*Command{
	{Name: "check", Summary: "compare the code's event types with the recorded snapshot (or one at a git ref) under a compatibility mode; exits 1 on a breaking change without a step",
		Long: `For a service's CI. The snapshot (--file, committed beside the code) records
every event type's current version and the JSON fields of each version
the code has had. A change that breaks events already stored (a required
field added or removed, a type changed, a rename) fails unless it comes as
a new version with a step from the old one (evolve.Up, evolve.Raw); the
output names the type, the version, the field and the rule. --write
records the code's snapshot once the check passes (or when there is none
yet). Modes as Confluent Schema Registry's: BACKWARD, FORWARD, FULL, each
also _TRANSITIVE (every recorded version, not only the last), NONE.`,
		Flags: schemaCheckFlags},
}}

func schemaCheckFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o SchemaCheck
	var mode string
	fs.StringVar(&o.File, "file", DefaultSchemaFile, "the snapshot file")
	fs.StringVar(&o.Ref, "ref", "", "read the snapshot from this git ref (git show REF:FILE) instead of the working tree")
	fs.StringVar(&mode, "mode", string(evolve.DefaultMode), "compatibility mode")
	fs.BoolVar(&o.Write, "write", false, "write the code's snapshot to --file after a passing check")
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		m, err := evolve.ParseMode(mode)
		if err != nil {
			return usagef("--mode: %v", err)
		}
		o.Mode = m
		if env.Options.App == nil {
			return errors.New("this binary has no application (cli.Options.App): there are no event types to check")
		}
		opts, err := env.Options.App()
		if err != nil {
			return err
		}
		o.Events = opts.Events
		return o.Run(ctx, env.Stdout)
	}
}

// SchemaCheck is `schema check`.
type SchemaCheck struct {
	File   string
	Ref    string
	Mode   evolve.Mode
	Write  bool
	JSON   bool
	Events []evolve.Schema
}

// Run checks and prints; violations are an ExitError with code 1.
func (o SchemaCheck) Run(ctx context.Context, w io.Writer) error {
	if o.File == "" {
		o.File = DefaultSchemaFile
	}
	if o.Mode == "" {
		o.Mode = evolve.DefaultMode
	}
	if strings.HasPrefix(o.Ref, "-") {
		// git would take it for one of its options (--output=FILE writes a
		// file): a ref never starts with "-".
		return UsageError{fmt.Errorf("--ref %q: a git ref does not start with \"-\"", o.Ref)}
	}
	var previous evolve.Snapshot
	data, err := o.read(ctx)
	switch {
	case errors.Is(err, os.ErrNotExist) && o.Ref == "":
		if !o.Write {
			return fmt.Errorf("no snapshot at %s: record the current event types with `%s schema check --write` and commit it", o.File, binaryName)
		}
	case err != nil:
		return err
	default:
		if err := json.Unmarshal(data, &previous); err != nil {
			return fmt.Errorf("reading the snapshot %s: %w", o.source(), err)
		}
	}
	violations := append([]evolve.Violation{}, evolve.Check(previous, o.Events, o.Mode)...)
	names := make([]string, 0, len(o.Events))
	for _, s := range o.Events {
		names = append(names, s.Name()+" v"+s.Current())
	}
	slices.Sort(names)
	if o.JSON {
		if err := WriteJSON(w, map[string]any{"against": o.source(), "mode": o.Mode, "types": names, "violations": violations}); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(w, "event types (%d): %s\nchecked against %s, mode %s\n", len(names), strings.Join(names, ", "), o.source(), o.Mode)
		if len(violations) == 0 {
			fmt.Fprintln(w, "compatible")
		}
		for _, v := range violations {
			fmt.Fprintf(w, "  - %s\n", v)
		}
	}
	if len(violations) > 0 {
		return ExitError{Code: 1, Err: fmt.Errorf("%d breaking change(s) without a step", len(violations))}
	}
	if o.Write {
		out, err := json.MarshalIndent(evolve.Take(o.Events, previous), "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.File, append(out, '\n'), 0o644); err != nil {
			return fmt.Errorf("writing the snapshot: %w", err)
		}
		if !o.JSON {
			fmt.Fprintf(w, "wrote %s\n", o.File)
		}
	}
	return nil
}

func (o SchemaCheck) source() string {
	if o.Ref != "" {
		return o.Ref + ":" + o.File
	}
	return o.File
}

func (o SchemaCheck) read(ctx context.Context) ([]byte, error) {
	if o.Ref == "" {
		return os.ReadFile(o.File)
	}
	// git show wants the path from the repository's root, or ./ for one
	// relative to the working directory.
	path := o.File
	if !strings.HasPrefix(path, "/") && !strings.HasPrefix(path, "./") {
		path = "./" + path
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "git", "show", "--end-of-options", o.Ref+":"+path)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("reading the snapshot at %s: git show: %v: %s", o.source(), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}
