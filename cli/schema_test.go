package cli_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/evolve"
)

type invoiceV1 struct {
	ID    string `json:"id"`
	Cents int64  `json:"cents"`
}

type invoiceV1Changed struct {
	ID    string `json:"id"`
	Cents string `json:"cents"`
}

type invoiceV2 struct {
	ID     string `json:"id"`
	Amount string `json:"amount"`
}

func schemaCLI(t *testing.T, events ...evolve.Schema) func(args ...string) (int, string) {
	return func(args ...string) (int, string) {
		var out, errOut bytes.Buffer
		c := cli.New(cli.Options{App: func() (app.Options, error) { return app.Options{Events: events}, nil }})
		code := c.Run(context.Background(), append([]string{"schema", "check"}, args...), &out, &errOut)
		return code, out.String() + errOut.String()
	}
}

// `ferry schema check` as a service's CI runs it: the first run records
// the snapshot (and a check without one says how), an in-place breaking
// change fails naming the type, the field and the rule, the same change as
// a new version with a step passes, and --ref reads the snapshot a commit
// has.
func TestSchemaCheckInAServicesCI(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	v1, err := evolve.New[invoiceV1]("invoices.issued", "1")
	require.NoError(t, err)

	code, out := schemaCLI(t, v1)()
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "no snapshot at ferry-schemas.json: record the current event types with `ferry schema check --write` and commit it")
	code, out = schemaCLI(t, v1)("--write")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "wrote ferry-schemas.json")
	code, out = schemaCLI(t, v1)()
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "compatible")

	changed, err := evolve.New[invoiceV1Changed]("invoices.issued", "1")
	require.NoError(t, err)
	code, out = schemaCLI(t, changed)("--write")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "invoices.issued version 1 field cents: type changed: from integer to string")
	code, out = schemaCLI(t, changed)("--mode", "none")
	require.Equal(t, 0, code, out)
	code, out = schemaCLI(t, changed)("--mode", "sideways")
	require.Equal(t, 2, code, out)

	v2, err := evolve.New[invoiceV2]("invoices.issued", "2", evolve.Up("1", "2", func(o invoiceV1) (invoiceV2, error) {
		return invoiceV2{ID: o.ID}, nil
	}))
	require.NoError(t, err)
	code, out = schemaCLI(t, v2)("--json")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, `"violations": []`)

	// The snapshot committed at a ref; the working tree's is then changed.
	git := func(args ...string) {
		cmd := exec.Command("git", append([]string{"-c", "user.email=t@example.com", "-c", "user.name=t"}, args...)...)
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", b)
	}
	git("init", "-q", "-b", "main")
	git("add", "ferry-schemas.json")
	git("commit", "-q", "-m", "snapshot")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ferry-schemas.json"), []byte(`{"types":{}}`), 0o644))
	code, out = schemaCLI(t, changed)()
	require.Equal(t, 0, code, "an empty snapshot knows no type: %s", out)
	code, out = schemaCLI(t, changed)("--ref", "main")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "checked against main:ferry-schemas.json")
	require.Contains(t, out, "field cents: type changed")
	code, out = schemaCLI(t, changed)("--ref", "no-such-ref")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "git show")
	// A ref that git would read as its own option is refused: it wrote
	// the file --output names.
	code, out = schemaCLI(t, changed)("--ref=--output=written")
	require.Equal(t, 2, code, out)
	require.Contains(t, out, `a git ref does not start with "-"`)
	require.NoFileExists(t, filepath.Join(dir, "written"))
}
