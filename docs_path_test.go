package ferry_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The concepts doc's "One event's path" names files and the functions to
// read in them; every one must exist where it says, so that a newcomer
// following it never meets a name that moved.
func TestEventPathAnchorsExist(t *testing.T) {
	doc, err := os.ReadFile("docs/concepts.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(doc)
	start := strings.Index(s, "## One event's path")
	if start < 0 {
		t.Fatal(`docs/concepts.md has no "One event's path" section`)
	}
	end := strings.Index(s[start+1:], "\n## ")
	section := s[start : start+1+end]
	anchor := regexp.MustCompile("`([a-z0-9_]+/[a-z0-9_/]+\\.go): ([A-Za-z_][A-Za-z0-9_]*)`|`([A-Za-z_][A-Za-z0-9_]*\\.go): ([A-Za-z_][A-Za-z0-9_]*)`|`([a-z][A-Za-z0-9]*)`")
	funcs := map[string]map[string]bool{}
	declared := func(path string) map[string]bool {
		if f, ok := funcs[path]; ok {
			return f
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		names := map[string]bool{}
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok {
				names[fd.Name.Name] = true
			}
		}
		funcs[path] = names
		return names
	}
	var file string
	checked := 0
	for _, m := range anchor.FindAllStringSubmatch(section, -1) {
		switch {
		case m[1] != "":
			file = m[1]
			if !declared(file)[m[2]] {
				t.Errorf("docs/concepts.md: %s has no function %s", m[1], m[2])
			}
		case m[3] != "":
			file = "pipeline/pgoutbox/" + m[3]
			if !declared(file)[m[4]] {
				t.Errorf("docs/concepts.md: %s has no function %s", file, m[4])
			}
		default:
			if file == "" || !regexp.MustCompile(`[A-Z]`).MatchString(m[5]) {
				continue // a column or a word, not a function's name
			}
			if !declared(file)[m[5]] {
				t.Errorf("docs/concepts.md: %s has no function %s", file, m[5])
			}
		}
		checked++
	}
	if checked < 15 {
		t.Errorf("only %d anchors read in docs/concepts.md's event path: the pattern no longer matches", checked)
	}
}
