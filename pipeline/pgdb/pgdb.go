// Package pgdb opens the pgx pools Ferry runs on, with its settings in
// one place: the schema (search_path), the application name that shows in
// pg_stat_activity, and an early, readable error when the server is not
// there.
package pgdb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	pgxconn "github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ferry-dev/ferry/pipeline"
)

// Config says where and how to connect.
type Config struct {
	// URL is a PostgreSQL connection URL or keyword/value string.
	URL string
	// Schema, when set, becomes the connections' search_path, so Ferry's
	// tables (and goose's version table) live in it.
	Schema string
	// ApplicationName shows in pg_stat_activity. Default "ferry".
	ApplicationName string
	// MaxConns is the pool size; 0 keeps pgx's default (max(4, CPUs)).
	MaxConns int32
	// Configure, if set, adjusts the pool's configuration last (a tracer:
	// pgoutbox.CommitWatch.Watch).
	Configure func(*pgxpool.Config)
}

// Open returns a pool, after checking that the server answers.
func Open(ctx context.Context, cfg Config) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parsing database URL %s: %w", Redact(cfg.URL), err)
	}
	if cfg.Schema != "" {
		if err := ValidateSchema(cfg.Schema); err != nil {
			return nil, err
		}
		// Quoted as an identifier, the rule CreateSchema and DropSchema
		// follow too: unquoted, "a,public" would be a list of two schemas
		// and "AuditMixed" would name auditmixed.
		pcfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = "ferry"
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	// JIT compiles a plan whose estimated cost passes jit_above_cost, and
	// the relay's statements over the outbox's partitions, on a partition
	// not analyzed yet, are estimated high: 500 ids took 3 s to look up, of
	// which 3 ms ran and the rest was LLVM compiling. Ferry's statements
	// are short; a URL that sets jit keeps its own.
	if _, ok := pcfg.ConnConfig.RuntimeParams["jit"]; !ok {
		pcfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	if cfg.MaxConns > 0 {
		pcfg.MaxConns = cfg.MaxConns
	}
	if cfg.Configure != nil {
		cfg.Configure(pcfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("creating database pool for %s: %w", Redact(cfg.URL), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, &unreachable{url: Redact(cfg.URL), err: err}
	}
	return pool, nil
}

// unreachable is Open's error when the server does not answer. pgx's own
// text for a failed connect lists every attempt on lines of its own (with
// sslmode=prefer, the same refusal twice: with TLS and without) behind
// "failed to connect to `user=… database=…`:"; this says each distinct
// reason once, on one line, and keeps pgx's error for errors.As.
type unreachable struct {
	url string
	err error
}

func (e *unreachable) Error() string {
	reason := e.err.Error()
	var ce *pgxconn.ConnectError
	if errors.As(e.err, &ce) && ce.Unwrap() != nil {
		reason = ce.Unwrap().Error()
	}
	var parts []string
	for _, p := range strings.Split(reason, "\n") {
		if p = strings.TrimSpace(p); p != "" && !slices.Contains(parts, p) {
			parts = append(parts, p)
		}
	}
	return fmt.Sprintf("cannot reach PostgreSQL at %s: %s", e.url, strings.Join(parts, "; "))
}

func (e *unreachable) Unwrap() error { return e.err }

// SQLDB returns a database/sql handle over pool (for watermill-sql and
// goose), sharing its connections and settings.
func SQLDB(pool *pgxpool.Pool) *sql.DB { return stdlib.OpenDBFromPool(pool) }

// MaxSchemaLength is PostgreSQL's identifier limit (NAMEDATALEN-1): a
// longer name would be silently truncated into another schema's name.
const MaxSchemaLength = 63

// ValidateSchema refuses a schema name PostgreSQL would not store as given
// (empty, longer than 63 bytes, or holding a NUL or another control
// character) or that is one of its own (pg_*, information_schema).
// Any other name, mixed case and punctuation included, is used exactly as
// written (quoted).
func ValidateSchema(schema string) error {
	switch {
	case schema == "":
		return errors.New("schema name is empty")
	case len(schema) > MaxSchemaLength:
		return fmt.Errorf("schema name %q is longer than %d bytes", schema, MaxSchemaLength)
	case !utf8.ValidString(schema) || strings.IndexFunc(schema, unicode.IsControl) >= 0:
		return fmt.Errorf("schema name %q holds invalid UTF-8 or a control character", schema)
	case strings.HasPrefix(strings.ToLower(schema), "pg_") || strings.EqualFold(schema, "information_schema"):
		return fmt.Errorf("schema name %q is PostgreSQL's own (pg_* and information_schema are system schemas): choose a schema of your own", schema)
	}
	return nil
}

// CreateSchema creates schema if it does not exist.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if err := ValidateSchema(schema); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("creating schema %q: %w", schema, err)
	}
	return nil
}

// EnsureSchema creates schema if it does not exist and checks that pool
// (opened with Config.Schema) now resolves unqualified names in it: a
// migration must never land in another schema than the one named.
func EnsureSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if err := CreateSchema(ctx, pool, schema); err != nil {
		return err
	}
	return CheckSchema(ctx, pool, schema)
}

// CheckSchema reports an error unless pool's current schema (the first
// existing schema of its search_path) is schema.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	var current *string
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return fmt.Errorf("reading the current schema: %w", err)
	}
	if current == nil || *current != schema {
		got := "(none)"
		if current != nil {
			got = strconv.Quote(*current)
		}
		return fmt.Errorf("the connections' current schema is %s, not %q: refusing to create tables elsewhere (is the pool's search_path the schema?)", got, schema)
	}
	return nil
}

// DropSchema drops schema and everything in it.
func DropSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if err := ValidateSchema(schema); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("dropping schema %q: %w", schema, err)
	}
	return nil
}

// Redact hides the credentials of a database setting, URL or
// keyword/value string, for messages and logs (pipeline.RedactURL).
func Redact(raw string) string { return pipeline.RedactURL(raw) }

// Unavailable reports whether err says the database could not do the work
// for a reason of its own rather than the statement's: the server
// unreachable or shutting down, the connection lost or reset, too many
// connections, a serialization failure or deadlock (both cured by trying
// again). A constraint violation, bad SQL or bad data is not.
func Unavailable(err error) bool {
	if err == nil {
		return false
	}
	// Any failure to connect, whatever the server answered: refusing
	// connections to the database (55000), no such database (3D000),
	// authentication (28000, 28P01), starting up (57P03). A connection
	// carries no message, so the message is never at fault. Checked before
	// the server's code, which such an error also carries.
	var connectErr *pgxconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	var pgErr *pgxconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case strings.HasPrefix(pgErr.Code, "08"), // connection exception
			strings.HasPrefix(pgErr.Code, "57P"),         // admin/crash shutdown, cannot connect now
			strings.HasPrefix(pgErr.Code, "53"),          // insufficient resources (too many connections, disk full)
			strings.HasPrefix(pgErr.Code, "58"),          // system error (I/O)
			pgErr.Code == "40001", pgErr.Code == "40P01", // serialization failure, deadlock
			pgErr.Code == "55P03",                                               // lock not available
			pgErr.Code == "25006",                                               // read-only transaction: a standby, before or during a failover
			pgErr.Code == "3D000", pgErr.Code == "28000", pgErr.Code == "28P01": // the database gone or access revoked mid-session
			return true
		}
		return false
	}
	if pgxconn.SafeToRetry(err) || pgxconn.Timeout(err) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	// pgx reports a use of a connection it has already closed (after a
	// broken one) with plain errors; pgxpool likewise for a closed pool.
	msg := err.Error()
	return strings.Contains(msg, "conn closed") || strings.Contains(msg, "conn busy") || strings.Contains(msg, "closed pool")
}

// MarkUnavailable returns err marked pipeline.Infrastructure when
// Unavailable(err), and err unchanged otherwise.
func MarkUnavailable(err error) error {
	if Unavailable(err) {
		return pipeline.Infrastructure(err)
	}
	return err
}
