package ferry_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The dependency arrows point one way; this test is the depguard of the
// layout: the core speaks Watermill and the standard library, handlers know
// no driver, nothing but the binary imports app.
func TestLayering(t *testing.T) {
	const mod = "github.com/ferry-dev/ferry"
	imports := map[string][]string{} // package dir -> imports of its non-test files
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") && path != "." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		dir := filepath.ToSlash(filepath.Dir(path))
		for _, imp := range f.Imports {
			imports[dir] = append(imports[dir], strings.Trim(imp.Path.Value, `"`))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	rules := []struct {
		dir    string
		banned func(imp string) bool
		why    string
	}{
		{"pipeline", func(imp string) bool {
			return strings.HasPrefix(imp, mod) || (strings.Contains(imp, ".") && !strings.HasPrefix(imp, "github.com/ThreeDotsLabs/watermill"))
		}, "the core speaks Watermill's message package and the standard library only"},
		{"handlers", func(imp string) bool {
			return strings.Contains(imp, "jackc/pgx") || strings.Contains(imp, "amqp") || imp == mod+"/app" || imp == mod+"/middleware"
		}, "handlers know no database or broker driver"},
		{"middleware", func(imp string) bool {
			return strings.Contains(imp, "jackc/pgx") || strings.Contains(imp, "amqp") || imp == mod+"/app" || imp == mod+"/handlers"
		}, "middleware takes its stores through interfaces"},
	}
	for dir, imps := range imports {
		for _, imp := range imps {
			if imp == mod+"/app" && dir != "cmd/ferry" {
				t.Errorf("%s imports app: only cmd/ferry may (app is the composition root)", dir)
			}
			for _, r := range rules {
				if (dir == r.dir || strings.HasPrefix(dir, r.dir+"/") && r.dir != "pipeline") && r.banned(imp) {
					t.Errorf("%s imports %s: %s", dir, imp, r.why)
				}
			}
			if strings.HasPrefix(dir, "pipeline/") && (imp == mod+"/app" || imp == mod+"/handlers" || imp == mod+"/middleware") {
				t.Errorf("%s imports %s: pipeline packages sit below handlers and middleware", dir, imp)
			}
		}
	}
}
