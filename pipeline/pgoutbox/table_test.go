package pgoutbox_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// One naming rule: names are taken literally, never split into a list,
// never silently replaced by the default; the tables beside the outbox
// live in its schema.
func TestParseTable(t *testing.T) {
	for in, want := range map[string][5]string{
		// quoted, archive, positions, pending view, key
		"":              {`"outbox"`, `"outbox_archive"`, `"ferry_relay_positions"`, `"ferry_outbox_pending"`, "outbox"},
		"outbox":        {`"outbox"`, `"outbox_archive"`, `"ferry_relay_positions"`, `"ferry_outbox_pending"`, "outbox"},
		"Outbox":        {`"Outbox"`, `"Outbox_archive"`, `"ferry_relay_positions"`, `"ferry_Outbox_pending"`, "Outbox"},
		"billing.inbox": {`"billing"."inbox"`, `"billing"."inbox_archive"`, `"billing"."ferry_relay_positions"`, `"billing"."ferry_inbox_pending"`, "billing.inbox"},
		"a,public":      {`"a,public"`, `"a,public_archive"`, `"ferry_relay_positions"`, `"ferry_a,public_pending"`, "a,public"},
		`we"ird`:        {`"we""ird"`, `"we""ird_archive"`, `"ferry_relay_positions"`, `"ferry_we""ird_pending"`, `we"ird`},
	} {
		tbl, err := pgoutbox.ParseTable(in)
		require.NoError(t, err, in)
		got := [5]string{tbl.Quoted(), tbl.Archive(), tbl.Positions(), tbl.View(pgoutbox.StatePending), tbl.Key()}
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"a.b.c", ".outbox", "outbox.", strings.Repeat("x", 64), strings.Repeat("x", 47), "out\x00box"} {
		_, err := pgoutbox.ParseTable(bad)
		require.Error(t, err, "%q", bad)
	}
	// The longest name whose views and archive still fit an identifier.
	_, err := pgoutbox.ParseTable(strings.Repeat("x", 46))
	require.NoError(t, err)
}

// The zero Table is the default table; InSchema qualifies every name but
// keeps the position's key, so a relay configured with the bare name and a
// publisher with the qualified one share one position.
func TestTableInSchema(t *testing.T) {
	var zero pgoutbox.Table
	require.Equal(t, pgoutbox.DefaultTable, zero.Name())
	q, err := zero.InSchema("svc")
	require.NoError(t, err)
	require.Equal(t, `"svc"."outbox"`, q.Quoted())
	require.Equal(t, `"svc"."ferry_relay_timelines"`, q.Timelines())
	require.Equal(t, `"svc"."ferry_outbox_dispatched"`, q.View(pgoutbox.StateDispatched))
	require.Equal(t, zero.Key(), q.Key())

	named, err := pgoutbox.ParseTable("billing.inbox")
	require.NoError(t, err)
	same, err := named.InSchema("svc")
	require.NoError(t, err)
	require.Equal(t, named, same, "a name that says its schema keeps it")
}

// The package doc's reading order names every file of the package, and
// only files that exist: a newcomer who follows it reads everything.
func TestPackageDocListsEveryFile(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	i := strings.Index(string(doc), "# Reading order")
	require.Positive(t, i, "doc.go has a reading order")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile(`\b([a-z_]+\.go)\b`).FindAllStringSubmatch(string(doc[i:]), -1) {
		listed[m[1]] = true
	}
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") || f == "doc.go" {
			continue
		}
		require.True(t, listed[f], "%s is missing from doc.go's reading order", f)
		delete(listed, f)
	}
	require.Empty(t, listed, "doc.go's reading order names files that do not exist")
}
