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

// QuoteTable is the one rule for the outbox table's name, used by every
// statement that names it (publisher, relay, retries, poison requeue,
// retention, status): "" means DefaultTable; "schema.table" names a table in
// another schema; each part is quoted as an identifier, so a name is taken
// literally ("Outbox" stays capitalised, "a,b" is one odd name, never two).
func QuoteTable(name string) (string, error) {
	if name == "" {
		name = DefaultTable
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return "", fmt.Errorf("outbox table %q: want table or schema.table", name)
	}
	for _, p := range parts {
		switch {
		case p == "":
			return "", fmt.Errorf("outbox table %q: empty name part", name)
		case len(p) > maxIdentifierLength:
			return "", fmt.Errorf("outbox table %q: %q is longer than %d bytes", name, p, maxIdentifierLength)
		case strings.ContainsRune(p, 0):
			return "", errors.New("outbox table name contains a NUL byte")
		}
	}
	return pgx.Identifier(parts).Sanitize(), nil
}
