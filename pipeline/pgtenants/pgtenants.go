// Package pgtenants keeps the tenant registry (ferry_tenants, migration
// 00033): the tenants whose outboxes one Ferry fleet serves, each in a
// database and schema of its own, in the fleet's control database. Adding,
// pausing, limiting and removing a tenant are audited, and every process of
// the fleet sees them at its next reload (tenancy.Fleet), without a restart.
//
// The registry is a table rather than a file: a file must reach every host
// of the fleet and be read by each alike, and a tenant added on one host
// but not yet on another is served by half a fleet; a row is one
// transaction every process reads. Its reload is a single-row read of the
// registry's version (ReadVersion), the full read only after a change.
package pgtenants

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
)

// Table is the registry's table.
const Table = "ferry_tenants"

// Audit log actions.
const (
	AddAction    = "tenant.add"
	RemoveAction = "tenant.remove"
	PauseAction  = "tenant.pause"
	ResumeAction = "tenant.resume"
	LimitAction  = "tenant.limit"
)

// Tenant is one tenant of the fleet.
type Tenant struct {
	ID string `json:"tenant_id"`
	// DatabaseURL is the tenant's database as stored: it may name
	// environment variables as ${NAME} (see Expand); "" is the control
	// database.
	DatabaseURL string `json:"database_url"`
	// Schema holds the tenant's outbox and ledger; "" is the database's
	// default search_path.
	Schema   string `json:"schema"`
	Paused   bool   `json:"paused"`
	PausedBy string `json:"paused_by,omitempty"`
	Reason   string `json:"reason,omitempty"`
	// RelayRate bounds the events a second the fleet relays for the
	// tenant; 0: no bound of its own.
	RelayRate float64 `json:"relay_rate"`
	// MaxHandlers bounds how many of the tenant's messages one process
	// handles at once; 0: no bound of its own.
	MaxHandlers int       `json:"max_handlers"`
	AddedAt     time.Time `json:"added_at"`
	UpdatedAt   time.Time `json:"updated_at"`
}

// Location says where the tenant's outbox is, its password left out.
func (t Tenant) Location() string {
	db := "the control database"
	if t.DatabaseURL != "" {
		db = pgdb.Redact(t.DatabaseURL)
	}
	if t.Schema == "" {
		return db
	}
	return db + ", schema " + t.Schema
}

var idPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

// ValidateID checks a tenant id: what the events' tenant_id header names,
// a metric label and part of names in logs, so plain and short.
func ValidateID(id string) error {
	if !idPattern.MatchString(id) {
		return fmt.Errorf("tenant id %q: use 1 to 63 lowercase letters, digits, '-' or '_', starting with a letter or digit", id)
	}
	return nil
}

// Validate checks what a tenant's row may hold, before any write.
func (t Tenant) Validate() error {
	var errs []error
	if err := ValidateID(t.ID); err != nil {
		errs = append(errs, err)
	}
	if t.Schema != "" {
		if err := pgdb.ValidateSchema(t.Schema); err != nil {
			errs = append(errs, fmt.Errorf("tenant %s: %w", t.ID, err))
		}
	}
	if t.DatabaseURL != "" {
		if _, err := Expand(t.DatabaseURL); err != nil {
			errs = append(errs, fmt.Errorf("tenant %s: %w", t.ID, err))
		} else if _, err := pgconn.ParseConfig(expandLenient(t.DatabaseURL)); err != nil {
			errs = append(errs, fmt.Errorf("tenant %s: database URL %s: %w", t.ID, pgdb.Redact(t.DatabaseURL), err))
		}
	}
	if t.RelayRate < 0 || math.IsNaN(t.RelayRate) || math.IsInf(t.RelayRate, 0) {
		errs = append(errs, fmt.Errorf("tenant %s: relay rate %v must be 0 (no limit) or a positive number of events a second", t.ID, t.RelayRate))
	}
	if t.MaxHandlers < 0 {
		errs = append(errs, fmt.Errorf("tenant %s: max handlers %d must be 0 (no limit) or positive", t.ID, t.MaxHandlers))
	}
	return errors.Join(errs...)
}

var reference = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)

// Expand replaces each ${NAME} in a tenant's database URL with the
// process's environment variable NAME: the registry holds where a tenant
// is, the hosts' secrets hold its password. An unset variable is an error
// naming it. A '$' not followed by '{' is the URL's own.
func Expand(url string) (string, error) {
	var missing []string
	out := reference.ReplaceAllStringFunc(url, func(ref string) string {
		name := reference.FindStringSubmatch(ref)[1]
		v, ok := os.LookupEnv(name)
		if !ok {
			missing = append(missing, name)
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("database URL %s names environment variables that are not set in this process: %s", pgdb.Redact(url), strings.Join(missing, ", "))
	}
	return out, nil
}

// expandLenient fills references with a placeholder, so that a URL's shape
// can be checked on a host that lacks its secrets.
func expandLenient(url string) string {
	return reference.ReplaceAllString(url, "x")
}

// Errors of the registry's writes.
var (
	ErrExists   = errors.New("a tenant with this id is registered already")
	ErrNotFound = errors.New("no tenant with this id is registered")
	ErrShared   = errors.New("another tenant is registered on this database and schema: two tenants on one outbox would read each other's events")
)

const columns = `tenant_id, database_url, schema_name, paused, paused_by, reason, relay_rate, max_handlers, added_at, updated_at`

func scan(row pgx.CollectableRow) (Tenant, error) {
	var t Tenant
	err := row.Scan(&t.ID, &t.DatabaseURL, &t.Schema, &t.Paused, &t.PausedBy, &t.Reason, &t.RelayRate, &t.MaxHandlers, &t.AddedAt, &t.UpdatedAt)
	return t, err
}

// Querier is what the registry's reads need: a pool, a connection or a
// transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// List returns every registered tenant, by id.
func List(ctx context.Context, q Querier) ([]Tenant, error) {
	rows, err := q.Query(ctx, `SELECT `+columns+` FROM `+Table+` ORDER BY tenant_id`)
	if err != nil {
		return nil, fmt.Errorf("reading the tenant registry: %w", err)
	}
	ts, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, fmt.Errorf("reading the tenant registry: %w", err)
	}
	return ts, nil
}

// Get returns one tenant, or ErrNotFound.
func Get(ctx context.Context, q Querier, id string) (Tenant, error) {
	rows, err := q.Query(ctx, `SELECT `+columns+` FROM `+Table+` WHERE tenant_id = $1`, id)
	if err != nil {
		return Tenant{}, fmt.Errorf("reading tenant %s: %w", id, err)
	}
	t, err := pgx.CollectExactlyOneRow(rows, scan)
	if errors.Is(err, pgx.ErrNoRows) {
		return Tenant{}, fmt.Errorf("tenant %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Tenant{}, fmt.Errorf("reading tenant %s: %w", id, err)
	}
	return t, nil
}

// Version is what changes whenever the registry does: a reload compares it
// before reading every row.
type Version int64

// versionTable holds the registry's Version, raised by every change in
// its transaction.
const versionTable = "ferry_tenants_version"

// ReadVersion reads the registry's version: one row.
func ReadVersion(ctx context.Context, q Querier) (Version, error) {
	var v Version
	if err := q.QueryRow(ctx, `SELECT version FROM `+versionTable).Scan(&v); err != nil {
		return 0, fmt.Errorf("reading the tenant registry's version: %w", err)
	}
	return v, nil
}

// bump raises the version in the change's transaction: the row lock
// orders the changes, so a reader never sees a change without its number.
func bump(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, `UPDATE `+versionTable+` SET version = version + 1`); err != nil {
		return fmt.Errorf("raising the tenant registry's version: %w", err)
	}
	return nil
}

// Add registers t on behalf of actor.
func Add(ctx context.Context, pool *pgxpool.Pool, t Tenant, actor string) error {
	if err := t.Validate(); err != nil {
		return err
	}
	if actor == "" {
		return errors.New("pgtenants: adding a tenant needs an actor for the audit log")
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+Table+` (tenant_id, database_url, schema_name, relay_rate, max_handlers, paused, paused_by, reason)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`, t.ID, t.DatabaseURL, t.Schema, t.RelayRate, t.MaxHandlers, t.Paused, t.PausedBy, pipeline.CleanText(t.Reason, 500))
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "23505" {
			if pe.ConstraintName == Table+"_pkey" {
				return fmt.Errorf("tenant %s: %w", t.ID, ErrExists)
			}
			return fmt.Errorf("tenant %s at %s: %w", t.ID, t.Location(), ErrShared)
		}
		if err != nil {
			return fmt.Errorf("adding tenant %s: %w", t.ID, err)
		}
		if err := bump(ctx, tx); err != nil {
			return err
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: AddAction, Scope: "tenant " + t.ID, Count: 1,
			Detail: map[string]any{"location": t.Location(), "relay_rate": t.RelayRate, "max_handlers": t.MaxHandlers, "paused": t.Paused}})
	})
}

// Remove unregisters tenant id on behalf of actor: the fleet stops serving
// its outbox and poisons its events that still reach the consumers, with
// the reason. Its database is left as it is.
func Remove(ctx context.Context, pool *pgxpool.Pool, id, actor string) error {
	return change(ctx, pool, id, actor, RemoveAction, nil, `DELETE FROM `+Table+` WHERE tenant_id = $1`, id)
}

// Pause stops the fleet relaying tenant id's events (they wait in its
// outbox) on behalf of actor, with why.
func Pause(ctx context.Context, pool *pgxpool.Pool, id, actor, reason string) error {
	reason = pipeline.CleanText(reason, 500)
	return change(ctx, pool, id, actor, PauseAction, map[string]any{"reason": reason},
		`UPDATE `+Table+` SET paused = true, paused_by = $2, reason = $3, updated_at = clock_timestamp() WHERE tenant_id = $1`, id, actor, reason)
}

// Resume undoes Pause on behalf of actor.
func Resume(ctx context.Context, pool *pgxpool.Pool, id, actor string) error {
	return change(ctx, pool, id, actor, ResumeAction, nil,
		`UPDATE `+Table+` SET paused = false, paused_by = '', reason = '', updated_at = clock_timestamp() WHERE tenant_id = $1`, id)
}

// Limit sets tenant id's relay rate (events/s) and handler bound on behalf
// of actor; 0 lifts either.
func Limit(ctx context.Context, pool *pgxpool.Pool, id string, relayRate float64, maxHandlers int, actor string) error {
	if err := (Tenant{ID: id, RelayRate: relayRate, MaxHandlers: maxHandlers}).Validate(); err != nil {
		return err
	}
	return change(ctx, pool, id, actor, LimitAction, map[string]any{"relay_rate": relayRate, "max_handlers": maxHandlers},
		`UPDATE `+Table+` SET relay_rate = $2, max_handlers = $3, updated_at = clock_timestamp() WHERE tenant_id = $1`, id, relayRate, maxHandlers)
}

func change(ctx context.Context, pool *pgxpool.Pool, id, actor, action string, detail map[string]any, sql string, args ...any) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	if actor == "" {
		return errors.New("pgtenants: a change to the registry needs an actor for the audit log")
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sql, args...)
		if err != nil {
			return fmt.Errorf("tenant %s: %w", id, err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("tenant %s: %w", id, ErrNotFound)
		}
		if err := bump(ctx, tx); err != nil {
			return err
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: action, Scope: "tenant " + id, Count: 1, Detail: detail})
	})
}
