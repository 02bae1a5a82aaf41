package pgoutbox

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DefaultTable is the outbox table's name when none is configured.
const DefaultTable = "outbox"

// maxIdentifierLength is PostgreSQL's NAMEDATALEN-1: a longer name would be
// truncated silently, and Ferry would then write one table and read another.
const maxIdentifierLength = 63

// archiveSuffix names the archive table beside the outbox table
// (migration 00007: outbox_archive).
const archiveSuffix = "_archive"

// Table is one outbox table, resolved once from the configuration: its
// quoted name and the names of the tables Ferry keeps beside it (the
// relay's position, the timeline, the archive). Every statement over the
// outbox takes its names from a Table, never from a string, so that a
// quoted name cannot be passed where a configured one was meant (the
// position is keyed by the configured name: a mix-up made every row read
// as pending, with no error).
//
// The zero Table is the default table, "outbox", in the search_path's
// schema.
type Table struct {
	// name is the table's name as configured ("" is DefaultTable): the
	// key of its rows in PositionTable and TimelineTable.
	name string
	// schema, if set, qualifies every name the configured one does not
	// qualify (InSchema).
	schema string
}

// ParseTable is the one rule for the outbox table's name: "" means
// DefaultTable; "schema.table" names a table in another schema; each part
// is taken literally as an identifier ("Outbox" stays capitalised, "a,b"
// is one odd name, never two).
func ParseTable(name string) (Table, error) {
	if name == "" {
		return Table{}, nil
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("outbox table %q: want table or schema.table", name)
	}
	for i, p := range parts {
		limit := maxIdentifierLength
		if i == len(parts)-1 {
			// The names beside it must fit too: its archive
			// (outbox_archive) and views (ferry_outbox_dispatched).
			limit -= max(len(archiveSuffix), len(viewPrefix)+1+longestState)
		}
		switch {
		case p == "":
			return Table{}, fmt.Errorf("outbox table %q: empty name part", name)
		case len(p) > limit:
			return Table{}, fmt.Errorf("outbox table %q: %q is longer than %d bytes", name, p, limit)
		case strings.ContainsRune(p, 0):
			return Table{}, errors.New("outbox table name contains a NUL byte")
		}
	}
	return Table{name: name}, nil
}

// InSchema returns t with its names qualified by schema where the
// configured name does not name one: the publisher writes through the
// caller's transaction, whose search_path may not be Ferry's. The
// position's key stays the configured name, so a relay configured with
// the bare name and a publisher with the qualified one share a position.
func (t Table) InSchema(schema string) (Table, error) {
	if schema == "" || strings.Contains(t.Name(), ".") {
		return t, nil
	}
	if len(schema) > maxIdentifierLength || strings.ContainsRune(schema, 0) {
		return Table{}, fmt.Errorf("schema %q: not a valid identifier", schema)
	}
	t.schema = schema
	return t, nil
}

// Name is the table's name as configured (DefaultTable when none was).
func (t Table) Name() string {
	if t.name == "" {
		return DefaultTable
	}
	return t.name
}

// String is Name.
func (t Table) String() string { return t.Name() }

// Key is the table's row in PositionTable and TimelineTable: its name as
// configured.
func (t Table) Key() string { return t.Name() }

// parts are the schema (or "") and the table's own name.
func (t Table) parts() (schema, name string) {
	n := t.Name()
	if i := strings.IndexByte(n, '.'); i >= 0 {
		return n[:i], n[i+1:]
	}
	return t.schema, n
}

// beside quotes name in the outbox table's schema.
func (t Table) beside(name string) string {
	schema, _ := t.parts()
	if schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{schema, name}.Sanitize()
}

// Quoted is the outbox table's name quoted as an identifier, qualified by
// its schema when it has one.
func (t Table) Quoted() string {
	_, name := t.parts()
	return t.beside(name)
}

// Archive is the quoted name of the archive table beside the outbox
// (its name with "_archive").
func (t Table) Archive() string {
	_, name := t.parts()
	return t.beside(name + archiveSuffix)
}

// Positions is the quoted name of PositionTable beside the outbox table.
func (t Table) Positions() string { return t.beside(PositionTable) }

// Timelines is the quoted name of TimelineTable beside the outbox table.
func (t Table) Timelines() string { return t.beside(TimelineTable) }

// Schema is the schema the table's name or InSchema gives, "" when it is
// the search_path's.
func (t Table) Schema() string {
	s, _ := t.parts()
	return s
}

// BaseName is the table's own name, without its schema.
func (t Table) BaseName() string {
	_, n := t.parts()
	return n
}
