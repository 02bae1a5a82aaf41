package display_test

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ferry-dev/ferry/internal/display"
)

func TestEscape(t *testing.T) {
	for in, want := range map[string]string{
		"a\x1b[31mred":    `a\x1b[31mred`,
		"evil\u202etxt":   `evil\u202etxt`,
		"bad\xffbyte":     `bad\xffbyte`,
		"c1\u0085nel":     `c1\x85nel`,
		"zero\u200bwidth": `zero\u200bwidth`,
		"line\nbreak\tok": "line\nbreak\tok",
	} {
		if got := display.Escape(in, 0, true); got != want {
			t.Errorf("Escape(%q) = %q, want %q", in, got, want)
		}
	}
	if got := display.Escape("a\nb", 0, false); got != `a\x0ab` {
		t.Errorf("without keepLines a line break is escaped: %q", got)
	}
	cut := display.Escape(strings.Repeat("\x1b", 50), 10, false)
	if utf8.RuneCountInString(cut) > 10 || !strings.HasSuffix(cut, "…") || strings.Count(cut, `\x1b`) != 2 {
		t.Errorf("escapes count toward the width and are never split: %q", cut)
	}
	if got := display.Cell("  two\r\n lines ", 80); got != "two lines" {
		t.Errorf("Cell folds white space: %q", got)
	}
	if got := display.Escape("exactly10!", 10, false); got != "exactly10!" {
		t.Errorf("a text of exactly max runes is not cut: %q", got)
	}
}

func TestAge(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "0s", -time.Minute: "0s", 45 * time.Second: "45s", 5*time.Minute + 3*time.Second: "5m 3s",
		3*time.Hour + 12*time.Minute + 9*time.Second: "3h 12m", 166*time.Hour + 36*time.Minute + 12*time.Second: "6d 22h",
	} {
		if got := display.Age(d); got != want {
			t.Errorf("Age(%s) = %q, want %q", d, got, want)
		}
	}
}
