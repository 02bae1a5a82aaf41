package ferrytest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// RequireStoredEventsDecode proves that the events a database holds still
// decode with the code under test: up to 100 of every (topic, schema
// version) in the outbox (pending, relayed, durable retries), its archive
// and the poison store go through their event type's chain (events,
// matched by topic) to the current type. Run it against a copy of
// production, or a staging database, before deploying a change to an
// event type. Events of a topic no chain names are reported in the log,
// not checked. table is the outbox table (the zero Table for "outbox").
func RequireStoredEventsDecode(t testing.TB, pool *pgxpool.Pool, table pgoutbox.Table, events ...evolve.Schema) {
	t.Helper()
	ctx := context.Background()
	var found bool
	var searchPath string
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, current_setting('search_path')`, table.Quoted()).Scan(&found, &searchPath); err != nil {
		t.Fatalf("ferrytest: RequireStoredEventsDecode: %v", err)
	}
	if !found {
		t.Fatalf("ferrytest: RequireStoredEventsDecode: no outbox table %s in search_path %q: open the pool on Ferry's schema (search_path in the URL, or pgdb.Config.Schema), or pass the table as schema.table", table, searchPath)
	}
	samples, err := pgstatus.VersionSamples(ctx, pool, table, 100)
	if err != nil {
		t.Fatalf("ferrytest: reading the stored events: %v", err)
	}
	byName := map[string]evolve.Schema{}
	for _, e := range events {
		byName[e.Name()] = e
	}
	var failures []string
	unchecked := map[string]int{}
	checked := map[string]int{} // "topic v<version> (place)" -> samples
	for _, s := range samples {
		e, ok := byName[s.Topic]
		if !ok {
			unchecked[s.Topic]++
			continue
		}
		checked[fmt.Sprintf("%s version %q (%s)", s.Topic, s.Version, s.Place)]++
		if err := e.Verify(s.Version, s.Payload); err != nil {
			failures = append(failures, fmt.Sprintf("%s #%d (%s, version %q): %v", s.Place, s.ID, s.Topic, s.Version, err))
		}
	}
	// Say what was checked: a pass over an empty database proves nothing,
	// and the log shows it.
	if len(checked) == 0 {
		t.Logf("ferrytest: no stored event of the %d event type(s) given was found in %s, its archive or the poison store: nothing checked", len(events), table)
	}
	for _, k := range slices.Sorted(maps.Keys(checked)) {
		t.Logf("ferrytest: decoded %d stored event(s) of %s", checked[k], k)
	}
	for _, topic := range slices.Sorted(maps.Keys(unchecked)) {
		t.Logf("ferrytest: %d stored event(s) of topic %s not checked: no chain in events names it", unchecked[topic], topic)
	}
	if len(failures) > 0 {
		t.Fatalf("ferrytest: %d stored event(s) no longer decode:\n  %s", len(failures), strings.Join(failures, "\n  "))
	}
}

// RequireCorpusDecodes proves that a golden corpus of sample payloads,
// kept in the repository, decodes with the code under test: dir holds
// <topic>/<version>/<name>.json, one event per file, and every version
// each chain reads must have at least one sample (an old version's
// samples are how a step keeps being tested after its producers are
// gone).
func RequireCorpusDecodes(t testing.TB, dir string, events ...evolve.Schema) {
	t.Helper()
	var failures []string
	for _, e := range events {
		for _, v := range e.Versions() {
			files, err := filepath.Glob(filepath.Join(dir, e.Name(), v, "*.json"))
			if err != nil {
				t.Fatalf("ferrytest: %v", err)
			}
			if len(files) == 0 {
				failures = append(failures, fmt.Sprintf("%s version %s: no sample in %s", e.Name(), v, filepath.Join(dir, e.Name(), v)))
			}
			for _, f := range files {
				payload, err := os.ReadFile(f)
				if err != nil {
					t.Fatalf("ferrytest: %v", err)
				}
				if err := e.Verify(v, payload); err != nil {
					failures = append(failures, fmt.Sprintf("%s: %v", f, err))
				}
			}
		}
	}
	// A sample of a topic or version no chain reads is a mistake in the
	// corpus, or a version whose step was deleted while events of it exist.
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(path) != ".json" {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		parts := strings.Split(filepath.ToSlash(rel), "/")
		if len(parts) != 3 {
			failures = append(failures, fmt.Sprintf("%s: want <topic>/<version>/<name>.json", path))
			return nil
		}
		if !slices.ContainsFunc(events, func(e evolve.Schema) bool { return e.Name() == parts[0] && slices.Contains(e.Versions(), parts[1]) }) {
			failures = append(failures, fmt.Sprintf("%s: no chain reads %s version %s", path, parts[0], parts[1]))
		}
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("ferrytest: %v", err)
	}
	if len(failures) > 0 {
		t.Fatalf("ferrytest: the corpus in %s does not decode:\n  %s", dir, strings.Join(failures, "\n  "))
	}
}
