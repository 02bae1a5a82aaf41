package cli

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestCellEscapesAndBounds(t *testing.T) {
	for in, want := range map[string]string{
		"plain":                   "plain",
		"a\x1b[31mred\x1b[0m":     `a\x1b[31mred\x1b[0m`,
		"evil\u202etxt.exe":       `evil\u202etxt.exe`,
		"two\r\nlines\tand  tabs": "two lines and tabs",
		"bell\a":                  `bell\x07`,
		"bad\xffutf8":             `bad\xffutf8`,
		"c1\u009bcsi":             `c1\x9bcsi`,
		"zero\u200bwidth":         `zero\u200bwidth`,
	} {
		if got := cell(in, 80); got != want {
			t.Errorf("cell(%q) = %q, want %q", in, got, want)
		}
	}
	long := cell(strings.Repeat("x", 5000), 40)
	if utf8.RuneCountInString(long) != 40 || !strings.HasSuffix(long, "…") {
		t.Errorf("a 5,000-character id is cut to 40 runes with an ellipsis: %q", long)
	}
	if got := cell(strings.Repeat("\x1b", 100), 10); utf8.RuneCountInString(got) > 10 {
		t.Errorf("escapes count toward the width: %q", got)
	}
}

// An embedding binary's help names it once, and so do its hints.
func TestEmbeddedBinaryNamesItself(t *testing.T) {
	var out, errOut strings.Builder
	c := New(Options{Name: "signups", Description: "signups: sends welcome mails"})
	require.Equal(t, 0, c.Run(context.Background(), []string{"help"}, &out, &errOut))
	require.True(t, strings.HasPrefix(out.String(), "signups: sends welcome mails\n"), out.String())
	require.NotContains(t, out.String(), "signups: signups")
	require.NotContains(t, out.String(), "ferry ")
	out.Reset()
	require.Equal(t, 0, c.Run(context.Background(), []string{"mcp", "-h"}, &out, &errOut))
	require.NotContains(t, out.String()+errOut.String(), "ferry run")
}
