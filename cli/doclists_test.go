package cli_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/ferry-dev/ferry/cli"
)

// The README's command table and the library guide's list name every
// command of the table (and each sub-command), so that a service's author
// learns of them all: both lists lagged behind the commands before.
func TestCommandListsNameEveryCommand(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	guide, err := os.ReadFile("../docs/library.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cli.Commands() {
		leaves := []string{c.Name}
		if len(c.Sub) > 0 {
			leaves = nil
			for _, s := range c.Sub {
				leaves = append(leaves, c.Name+" "+s.Name)
			}
		}
		for _, l := range leaves {
			if !strings.Contains(string(readme), "`ferry "+l+"`") {
				t.Errorf("README.md's command table does not name `ferry %s`", l)
			}
			if !guideNames(string(guide), c.Name, l) {
				t.Errorf("docs/library.md's command list does not name %q", l)
			}
		}
	}
}

// guideNames reports whether the guide lists leaf: `name`, `name sub`, or
// sub among `name a|b|c`.
func guideNames(guide, name, leaf string) bool {
	if strings.Contains(guide, "`"+leaf+"`") {
		return true
	}
	sub := strings.TrimPrefix(leaf, name+" ")
	for _, m := range regexp.MustCompile("`"+regexp.QuoteMeta(name)+` ([a-z|-]+)`+"`").FindAllStringSubmatch(guide, -1) {
		for _, s := range strings.Split(m[1], "|") {
			if s == sub {
				return true
			}
		}
	}
	return false
}
