package cli

import (
	"flag"
	"io"
	"testing"
)

// Flags may follow the arguments, as the docs write command lines; "--"
// ends the flags.
func TestFlagsAnywhereOnTheCommandLine(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		positional []string
		reason     string
		json       bool
	}{
		{[]string{"payments.charge", "--reason", "provider down"}, []string{"payments.charge"}, "provider down", false},
		{[]string{"--reason", "x", "payments.charge", "--json"}, []string{"payments.charge"}, "x", true},
		{[]string{"a", "--json", "b"}, []string{"a", "b"}, "", true},
		{[]string{"a", "--", "--json"}, []string{"a", "--json"}, "", false},
		{[]string{"--", "-5"}, []string{"-5"}, "", false},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		reason := fs.String("reason", "", "")
		asJSON := fs.Bool("json", false, "")
		got, err := parseInterspersed(fs, tc.args)
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if len(got) != len(tc.positional) || (len(got) > 0 && got[0] != tc.positional[0]) || (len(got) > 1 && got[1] != tc.positional[1]) {
			t.Errorf("%q: positional %q, want %q", tc.args, got, tc.positional)
		}
		if *reason != tc.reason || *asJSON != tc.json {
			t.Errorf("%q: reason %q json %v, want %q %v", tc.args, *reason, *asJSON, tc.reason, tc.json)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if _, err := parseInterspersed(fs, []string{"a", "--nope"}); err == nil {
		t.Error("an unknown flag after an argument is refused")
	}
}
