package cli

import (
	"strings"
	"testing"
	"unicode/utf8"
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
