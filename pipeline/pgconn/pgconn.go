// Package pgconn opens the pgx pools Ferry runs on, with its settings in
// one place: the schema (search_path), the application name that shows in
// pg_stat_activity, and an early, readable error when the server is not
// there.
package pgconn

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
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
}

// Open returns a pool, after checking that the server answers.
func Open(ctx context.Context, cfg Config) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parsing database URL %s: %w", Redact(cfg.URL), err)
	}
	if cfg.Schema != "" {
		pcfg.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = "ferry"
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	if cfg.MaxConns > 0 {
		pcfg.MaxConns = cfg.MaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("creating database pool for %s: %w", Redact(cfg.URL), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s: %w", Redact(cfg.URL), err)
	}
	return pool, nil
}

// SQLDB returns a database/sql handle over pool (for watermill-sql and
// goose), sharing its connections and settings.
func SQLDB(pool *pgxpool.Pool) *sql.DB { return stdlib.OpenDBFromPool(pool) }

// CreateSchema creates schema if it does not exist.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if schema == "" {
		return errors.New("pgconn: empty schema name")
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("creating schema %q: %w", schema, err)
	}
	return nil
}

// DropSchema drops schema and everything in it.
func DropSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if schema == "" {
		return errors.New("pgconn: empty schema name")
	}
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("dropping schema %q: %w", schema, err)
	}
	return nil
}

// Redact hides the password of a database URL for messages and logs.
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme == "" {
		return "<database URL>"
	}
	return u.Redacted()
}
