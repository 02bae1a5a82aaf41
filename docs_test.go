package ferry_test

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var updateDocs = flag.Bool("update", false, "rewrite the docs' Go snippets from their source regions")

// snippetMarker stands on the line before a Go block in the docs and names
// the region of a compiled file the block shows:
//
//	<!-- snippet: examples/invoices/invoices.go#issue -->
//
// The region is marked in the source with "// snippet:begin issue" and
// "// snippet:end issue".
var snippetMarker = regexp.MustCompile(`^<!-- snippet: ([^#\s]+)#([\w.-]+) -->$`)

// Every Go block in the README and docs/ is a region of a file CI compiles
// (an example, an Example test, a service under examples/): a snippet no
// compiler sees drifts. A block without its marker, or one that differs
// from its region, fails; `go test . -run TestDocSnippets -update`
// rewrites the blocks from their sources.
func TestDocSnippets(t *testing.T) {
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, "README.md")
	regions := 0
	for _, page := range pages {
		src, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		out, n, errs := renderSnippets(page, string(src))
		regions += n
		for _, e := range errs {
			t.Error(e)
		}
		if out == string(src) {
			continue
		}
		if *updateDocs {
			if err := os.WriteFile(page, []byte(out), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		t.Errorf("%s: a Go snippet differs from its source region: run `go test . -run TestDocSnippets -update`", page)
	}
	if regions < 10 {
		t.Errorf("only %d snippets found in the docs: the markers are not being read", regions)
	}
}

// renderSnippets returns page with every marked Go block replaced by its
// region, how many regions it found, and what is wrong.
func renderSnippets(page, src string) (string, int, []error) {
	var (
		out    strings.Builder
		errs   []error
		n      int
		marker []string
		skip   bool
	)
	sc := bufio.NewScanner(strings.NewReader(src))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	line := 0
	for sc.Scan() {
		l := sc.Text()
		line++
		trimmed := strings.TrimSpace(l)
		switch {
		case skip:
			if trimmed == "```" {
				skip = false
				out.WriteString(l + "\n")
			}
			continue
		case snippetMarker.MatchString(trimmed):
			marker = snippetMarker.FindStringSubmatch(trimmed)
		case strings.HasPrefix(trimmed, "```go"):
			if marker == nil {
				errs = append(errs, fmt.Errorf("%s:%d: a Go block without a <!-- snippet: file.go#region --> line before it", page, line))
				break
			}
			body, err := region(marker[1], marker[2])
			if err != nil {
				errs = append(errs, fmt.Errorf("%s:%d: %w", page, line, err))
				marker = nil
				break
			}
			n++
			indent := l[:len(l)-len(strings.TrimLeft(l, " \t"))]
			out.WriteString(l + "\n")
			for _, b := range strings.Split(body, "\n") {
				if b == "" {
					out.WriteString("\n")
				} else {
					out.WriteString(indent + b + "\n")
				}
			}
			marker, skip = nil, true
			continue
		case trimmed != "":
			marker = nil
		}
		out.WriteString(l + "\n")
	}
	return out.String(), n, errs
}

// region reads the lines between "// snippet:begin name" and
// "// snippet:end name" of file, less their common indentation.
func region(file, name string) (string, error) {
	src, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	begin, end := []byte("// snippet:begin "+name+"\n"), []byte("// snippet:end "+name)
	i := bytes.Index(src, begin)
	if i < 0 {
		return "", fmt.Errorf("%s has no region %q", file, name)
	}
	rest := src[i+len(begin):]
	j := bytes.Index(rest, end)
	if j < 0 {
		return "", fmt.Errorf("%s: region %q has no end", file, name)
	}
	lines := strings.Split(strings.TrimRight(string(rest[:j]), " \t\n"), "\n")
	common := ""
	for k, l := range lines {
		if strings.TrimSpace(l) == "" {
			continue
		}
		ind := l[:len(l)-len(strings.TrimLeft(l, "\t"))]
		if k == 0 || len(ind) < len(common) || common == "" && ind == "" {
			common = ind
		}
	}
	for k, l := range lines {
		lines[k] = strings.TrimRight(strings.TrimPrefix(l, common), " \t")
	}
	// Region markers of other regions inside this one are not shown.
	kept := lines[:0]
	for _, l := range lines {
		if !strings.HasPrefix(strings.TrimSpace(l), "// snippet:") {
			kept = append(kept, l)
		}
	}
	return strings.Trim(strings.Join(kept, "\n"), "\n"), nil
}

// A package doc that names a path (pipeline/pgoutbox, examples/orders,
// cmd/ferry) or lists packages ("  - handlers, middleware: …") names ones
// that exist: a doc that outlives a move misleads the next reader.
func TestPackageDocsNamePathsThatExist(t *testing.T) {
	top, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	roots := map[string]bool{}
	for _, e := range top {
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") {
			roots[e.Name()] = true
		}
	}
	pathLike := regexp.MustCompile(`\b([a-z][a-z0-9_]*)(/[a-z][a-z0-9_]*)+\b`)
	bullet := regexp.MustCompile(`^//\s+- ([a-z][a-z0-9_/]*(?:, [a-z][a-z0-9_/]*)*)(?:,? and [a-z][a-z0-9_/]*)?:`)
	err = filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") && path != "." {
			return filepath.SkipDir
		}
		if d.IsDir() || filepath.Base(path) != "doc.go" {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		dir := filepath.Dir(path)
		exists := func(p string) bool {
			for _, base := range []string{".", dir} {
				if _, err := os.Stat(filepath.Join(base, p)); err == nil {
					return true
				}
			}
			return false
		}
		for _, line := range strings.Split(string(src), "\n") {
			if !strings.HasPrefix(line, "//") {
				continue
			}
			for _, m := range pathLike.FindAllStringSubmatch(line, -1) {
				if roots[m[1]] && !exists(m[0]) {
					t.Errorf("%s names %s, which does not exist", path, m[0])
				}
			}
			if m := bullet.FindStringSubmatch(line); m != nil {
				for _, name := range strings.Split(m[1], ", ") {
					if !exists(name) {
						t.Errorf("%s lists package %s, which does not exist", path, name)
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
