package ferry_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The dependency arrows point one way; this test is the depguard of the
// layout: the core speaks Watermill and the standard library, handlers know
// no driver, the library imports no example and no rig (examples/,
// internal/), and only the CLI, ferrytest (the one public test package),
// binaries, examples and rigs import app.
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
		{"evolve", func(imp string) bool {
			return strings.Contains(imp, "jackc/pgx") || strings.Contains(imp, "amqp") || (strings.HasPrefix(imp, mod) && imp != mod+"/pipeline" && imp != mod+"/strictjson")
		}, "event versions are pure functions over payloads: the core and strict JSON only"},
		{"middleware", func(imp string) bool {
			return strings.Contains(imp, "jackc/pgx") || strings.Contains(imp, "amqp") || imp == mod+"/app" || imp == mod+"/handlers"
		}, "middleware takes its stores through interfaces"},
	}
	// The importable library holds no example and no test rig: only the
	// binary's tree, the examples and the rigs may import them. internal/
	// holds the library's own helpers, not part of its API, and no rig.
	library := func(dir string) bool {
		return !strings.HasPrefix(dir, "cmd/") && !strings.HasPrefix(dir, "examples/") && !strings.HasPrefix(dir, "testrig/")
	}
	for dir, imps := range imports {
		for _, imp := range imps {
			if imp == mod+"/app" && library(dir) && dir != "cli" && dir != "ferrytest" {
				t.Errorf("%s imports app: only cli, ferrytest (which starts a user's app in a test), binaries, examples and rigs may (app is the composition root)", dir)
			}
			if dir != "ferrytest" && !strings.HasPrefix(dir, "testrig/") && !strings.HasPrefix(dir, "cmd/") && !strings.HasPrefix(dir, "examples/") && imp == mod+"/ferrytest" {
				t.Errorf("%s imports ferrytest: the test package is for tests and rigs", dir)
			}
			if library(dir) && (strings.HasPrefix(imp, mod+"/examples/") || rig(imp)) {
				t.Errorf("%s imports %s: the library holds no example and no test rig", dir, imp)
			}
			if strings.HasPrefix(dir, "internal/") && (imp == "testing" || imp == mod+"/app" || imp == mod+"/ferrytest" || rig(imp)) {
				t.Errorf("%s imports %s: internal/ holds the library's private helpers only; rigs live beside their binary (cmd/ferry/internal/) or in testrig/", dir, imp)
			}
			if strings.HasPrefix(dir, "examples/") && (strings.HasPrefix(imp, mod+"/internal/") || rig(imp)) {
				t.Errorf("%s imports %s: examples use only the public API", dir, imp)
			}
			if strings.HasPrefix(dir, "examples/invoices") && strings.HasPrefix(imp, mod+"/examples/") && !strings.HasPrefix(imp, mod+"/examples/invoices") {
				t.Errorf("%s imports %s: the user application stands on the library alone", dir, imp)
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

// `go list -deps ./app` names no example and no rig, and `go doc ./app`
// shows no bench, chaos, scenario or fault-injection symbol.
func TestAppIsTheRuntimeOnly(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "./app", "./cli").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if strings.Contains(pkg, "ferry-dev/ferry/examples") || rig(pkg) {
			t.Errorf("app or cli depends on %s", pkg)
		}
	}
	doc, err := exec.Command("go", "doc", "-all", "./app").CombinedOutput()
	if err != nil {
		t.Fatalf("go doc: %v\n%s", err, doc)
	}
	for _, word := range []string{"Bench", "Chaos", "Scenario", "Fault", "Demo", "Orders", "PaymentURL", "SMTP", "ExampleRoutes"} {
		if strings.Contains(string(doc), word) {
			t.Errorf("go doc ./app mentions %q: the runtime carries no example or rig", word)
		}
	}
}

// rig reports whether an import path is one of the test and benchmark
// rigs: the binary's own (cmd/ferry/internal/: bench, chaos, demo, as
// River keeps its bench beside its binary) and Ferry's test rig (testrig/),
// as opposed to the library's private helpers under internal/.
func rig(imp string) bool {
	const mod = "github.com/ferry-dev/ferry/"
	return strings.HasPrefix(imp, mod+"cmd/ferry/internal/") || imp == mod+"testrig" || strings.HasPrefix(imp, mod+"testrig/")
}

// Every table has one owner: only the package that owns a table writes SQL
// over it, and pgstatus is the one reader for reports. A statement is
// found by the table named after FROM, INTO, UPDATE, JOIN, TABLE or
// TRUNCATE in a string literal, or by the owner's table name or quoting
// function used elsewhere. Migrations (DDL), the binary's tree, the
// examples, the rigs, ferrytest (a test reads the tables it asserts on)
// and tests are outside the rule.
func TestEveryTableHasOneOwner(t *testing.T) {
	owners := map[string][]string{
		"outbox":                 {"pipeline/pgoutbox"},
		"outbox_archive":         {"pipeline/pgoutbox"},
		"poison_messages":        {"pipeline/pgpoison"},
		"processed_messages":     {"pipeline/pgledger"},
		"ferry_ledger_ring":      {"pipeline/pgledger"},
		"ferry_audit_log":        {"pipeline/pgaudit"},
		"ferry_tool_calls":       {"pipeline/pgtoolcalls"},
		"budget_usage":           {"pipeline/pgbudget"},
		"ferry_backfill_items":   {"adoption/backfill"},
		"ferry_legacy_effects":   {"adoption/shadow"},
		"ferry_instances":        {"pipeline/pgstatus"},
		"ferry_held_partitions":  {"pipeline/pgheld"},
		"ferry_samples":          {"pipeline/pgstatus"},
		"ferry_routes":           {"pipeline/pgstatus"},
		"ferry_console_sessions": {"pipeline/pgsession"},
		"ferry_relay_timelines":  {"pipeline/pgoutbox"},
		"ferry_relay_positions":  {"pipeline/pgoutbox"},
		"ferry_poison_archive":   {"pipeline/pgpoison"},
		"ferry_handler_pauses":   {"pipeline/pgpause"},
		"ferry_jobs":             {"pipeline/pgjobs"},
		"ferry_confirmations":    {"pipeline/pgconfirm"},
		"ferry_tenants":          {"pipeline/pgtenants"},
		"ferry_tenants_version":  {"pipeline/pgtenants"},
		"ferry_parked":           {"pipeline/pgparked"},
	}
	// Reports (pgstatus, metrics) compose the owners' typed reads: no
	// package reads another's table, not even to report on it.
	// Names that stand for a table in code: the owner's constant or
	// quoting function. pgcdc names the outbox in its publication (DDL).
	handles := map[string][]string{
		"pgpoison.Table":        {"pipeline/pgpoison"},
		"pgpoison.ArchiveTable": {"pipeline/pgpoison"},
		"pgjobs.Table":          {"pipeline/pgjobs"},
		"pgconfirm.Table":       {"pipeline/pgconfirm"},
		"pgheld.Table":          {"pipeline/pgheld"},
		"pgpause.Table":         {"pipeline/pgpause"},
		"pgstatus.RoutesTable":  {"pipeline/pgstatus"},
		"pgtoolcalls.Table":     {"pipeline/pgtoolcalls", "agenttools"},
		"shadow.Table":          {"adoption/shadow"},
		"backfill.ItemsTable":   {"adoption/backfill"},
		"pgledger.DefaultTable": {"pipeline/pgledger"},
		"pgtenants.Table":       {"pipeline/pgtenants"},
		"pgparked.Table":        {"pipeline/pgparked"},
	}
	outside := func(dir string) bool {
		return dir == "." || dir == "migrations" || dir == "ferrytest" || strings.HasPrefix(dir, "cmd/") || strings.HasPrefix(dir, "examples/") ||
			strings.HasPrefix(dir, "testrig/") || strings.HasPrefix(dir, "ferrylint")
	}
	verb := regexp.MustCompile(`(?i)\b(from|into|update|join|table|truncate)\s+(?:only\s+)?(?:"?[a-z_]+"?\.)?"?([a-z_]+)\b`)
	walkGo(t, func(path, dir string) bool { return !strings.HasSuffix(path, "_test.go") && !outside(dir) }, func(path, dir string, f *ast.File, tags map[*ast.BasicLit]bool) {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.BasicLit:
				if n.Kind != token.STRING || tags[n] {
					return true
				}
				s, err := strconv.Unquote(n.Value)
				if err != nil {
					return true
				}
				if strings.Contains(s, "dispatched_at") && dir != "pipeline/pgoutbox" {
					t.Errorf("%s: names dispatched_at outside pgoutbox: a row sent at its first try keeps it NULL; ask pgoutbox's typed reads or views", path)
				}
				for _, m := range verb.FindAllStringSubmatch(s, -1) {
					table := strings.ToLower(m[2])
					allowed, known := owners[table]
					if !known || slices.Contains(allowed, dir) {
						continue
					}
					t.Errorf("%s: SQL over %s outside its owner %v: %q", path, table, allowed, m[0])
				}
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok {
					name := x.Name + "." + n.Sel.Name
					if allowed, ok := handles[name]; ok && !slices.Contains(allowed, dir) {
						t.Errorf("%s: uses %s outside the table's owner %v: ask the owner for what you need", path, name, allowed)
					}
				}
			}
			return true
		})
	})
}

// Nothing outside pgoutbox and the migrations names the outbox's tables in
// SQL or dispatched_at, tests, examples and commands included: they ask
// pgoutbox's typed reads, the views or the test rig's row factory, so that
// every suite passes with the outbox renamed and no reader counts a row
// sent at its first try (dispatched_at NULL) as pending. The exceptions
// say why.
func TestNothingOutsidePgoutboxNamesTheOutbox(t *testing.T) {
	allowed := map[string]string{
		"testrig/pipelinetest/outboxrows.go": "the row factory writes the states only the relay makes",
		"layering_test.go":                   "this rule",
	}
	allowedDirs := map[string]string{
		"pipeline/pgoutbox": "the owner",
		"migrations":        "the schema",
		// The bench loads, empties and vacuums the table it measures and
		// marks rows as the per-row design did, to compare against it.
		"cmd/ferry/internal/bench": "measures the table itself",
	}
	names := regexp.MustCompile(`(?i)\b(from|into|update|join|table|truncate|analyze|on)\s+(?:only\s+)?(?:"?[a-z_]+"?\.)?"?(outbox|outbox_archive|outbox_legacy|ferry_relay_positions|ferry_relay_timelines)\b"?(?:[^_a-z]|$)`)
	var found []string
	walkGo(t, func(path, dir string) bool { return allowed[path] == "" && allowedDirs[dir] == "" }, func(path, _ string, f *ast.File, tags map[*ast.BasicLit]bool) {
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING || tags[lit] {
				return true
			}
			s, err := strconv.Unquote(lit.Value)
			if err != nil {
				return true
			}
			if strings.Contains(s, "dispatched_at") {
				found = append(found, path+": dispatched_at")
			}
			for _, m := range names.FindAllStringSubmatch(s, -1) {
				found = append(found, fmt.Sprintf("%s: %q", path, strings.TrimSpace(m[0])))
			}
			return true
		})
	})
	for _, f := range found {
		t.Errorf("%s: ask pgoutbox's typed reads (Rows, CountPending, SentMessageIDs, Timeline…), its views or pipelinetest.InsertOutbox", f)
	}
}

// walkGo parses every Go file of the tree that include takes (by its
// slash path and directory; dot-directories, testdata and node_modules
// skipped) and hands it to visit with its struct tags, which name JSON
// fields, not columns.
func walkGo(t *testing.T, include func(path, dir string) bool, visit func(path, dir string, f *ast.File, tags map[*ast.BasicLit]bool)) {
	t.Helper()
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") && path != "." {
			return filepath.SkipDir
		}
		path = filepath.ToSlash(path)
		dir := filepath.ToSlash(filepath.Dir(path))
		if d.IsDir() || !strings.HasSuffix(path, ".go") || !include(path, dir) {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		tags := map[*ast.BasicLit]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			if fd, ok := n.(*ast.Field); ok && fd.Tag != nil {
				tags[fd.Tag] = true
			}
			return true
		})
		visit(path, dir, f, tags)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
