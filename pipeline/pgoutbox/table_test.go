package pgoutbox_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// One quoting rule: names are taken literally, never split into a list,
// never silently replaced by the default.
func TestQuoteTable(t *testing.T) {
	for in, want := range map[string]string{
		"":              `"outbox"`,
		"outbox":        `"outbox"`,
		"Outbox":        `"Outbox"`,
		"billing.inbox": `"billing"."inbox"`,
		"a,public":      `"a,public"`,
		`we"ird`:        `"we""ird"`,
	} {
		got, err := pgoutbox.QuoteTable(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"a.b.c", ".outbox", "outbox.", strings.Repeat("x", 64), "out\x00box"} {
		_, err := pgoutbox.QuoteTable(bad)
		require.Error(t, err, "%q", bad)
		_, err = pgoutbox.ClaimSQL(bad, false)
		require.Error(t, err, "ClaimSQL(%q) refuses instead of falling back to the default table", bad)
	}
}
