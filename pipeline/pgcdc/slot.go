package pgcdc

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// SlotStatus is what PostgreSQL says of a replication slot, for `ferry
// status`, the metrics and the alerts.
type SlotStatus struct {
	Name   string `json:"name"`
	Exists bool   `json:"exists"`
	// Active: a streamer is connected (ActivePID is its walsender).
	Active    bool   `json:"active"`
	ActivePID int    `json:"active_pid,omitempty"`
	Plugin    string `json:"plugin,omitempty"`
	Database  string `json:"database,omitempty"`
	// ConfirmedLSN is the confirmed flush position: everything committed
	// before it was relayed (or left to the polling relay).
	ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
	// LagBytes is the WAL between the server's current position and
	// ConfirmedLSN.
	LagBytes int64 `json:"lag_bytes"`
	// RetainedBytes is the WAL the slot keeps on disk (from restart_lsn).
	RetainedBytes int64 `json:"retained_bytes"`
	// WALStatus is pg_replication_slots.wal_status: reserved, extended,
	// unreserved, or lost (max_slot_wal_keep_size invalidated the slot).
	WALStatus string `json:"wal_status,omitempty"`
}

// ReadSlot reads slot's status; Exists is false when there is none.
func ReadSlot(ctx context.Context, pool *pgxpool.Pool, slot string) (SlotStatus, error) {
	st := SlotStatus{Name: slot}
	err := pool.QueryRow(ctx, `
		SELECT active, COALESCE(active_pid, 0), plugin, COALESCE(database, ''),
		       COALESCE(confirmed_flush_lsn::text, ''),
		       COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint,
		       COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint,
		       COALESCE(wal_status, '')
		FROM pg_replication_slots WHERE slot_name = $1`, slot).
		Scan(&st.Active, &st.ActivePID, &st.Plugin, &st.Database, &st.ConfirmedLSN, &st.LagBytes, &st.RetainedBytes, &st.WALStatus)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("reading replication slot %s: %w", slot, err)
	}
	st.Exists = true
	return st, nil
}

// Names returns the slot and publication names cfg resolves to on pool's
// database and schema (see DefaultName).
func Names(ctx context.Context, pool *pgxpool.Pool, cfg Config) (slot, publication string, err error) {
	slot, publication = cfg.Slot, cfg.Publication
	if slot == "" {
		var db, schema string
		if err := pool.QueryRow(ctx, `SELECT current_database(), current_schema()`).Scan(&db, &schema); err != nil {
			return "", "", fmt.Errorf("reading the database and schema: %w", err)
		}
		slot = DefaultName(db, schema)
	}
	if publication == "" {
		publication = slot
	}
	return slot, publication, nil
}

// ErrSlotActive: Drop found a streamer using the slot.
var ErrSlotActive = errors.New("the replication slot is in use")

// DropWhenInactive is Drop, waiting (until ctx ends) for a streamer that
// was just stopped to let go of the slot: its walsender may outlive the
// client's connection by a moment.
func DropWhenInactive(ctx context.Context, pool *pgxpool.Pool, slot, publication string) (droppedSlot, droppedPublication bool, err error) {
	for {
		droppedSlot, droppedPublication, err = Drop(ctx, pool, slot, publication)
		if !errors.Is(err, ErrSlotActive) {
			return droppedSlot, droppedPublication, err
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return false, false, err
		case <-t.C:
		}
	}
}

// Drop removes the slot and the publication: how CDC is switched off for
// good (a slot nobody streams retains WAL for ever). A slot a streamer is
// using is refused: stop it first. Missing ones are not an error; the
// return says what was there.
func Drop(ctx context.Context, pool *pgxpool.Pool, slot, publication string) (droppedSlot, droppedPublication bool, err error) {
	if err := ValidateName(slot); err != nil {
		return false, false, fmt.Errorf("slot %w", err)
	}
	if err := ValidateName(publication); err != nil {
		return false, false, fmt.Errorf("publication %w", err)
	}
	st, err := ReadSlot(ctx, pool, slot)
	if err != nil {
		return false, false, err
	}
	if st.Exists {
		if st.Active {
			return false, false, fmt.Errorf("replication slot %s is in use by walsender pid %d: stop the CDC relay first: %w", slot, st.ActivePID, ErrSlotActive)
		}
		if _, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err != nil {
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "42704" { // undefined_object: dropped meanwhile
				return false, false, fmt.Errorf("dropping replication slot %s: %w", slot, err)
			}
		}
		droppedSlot = true
	}
	var existed bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, publication).Scan(&existed); err != nil {
		return droppedSlot, false, fmt.Errorf("reading publication %s: %w", publication, err)
	}
	if !existed {
		return droppedSlot, false, nil
	}
	if _, err := pool.Exec(ctx, `DROP PUBLICATION IF EXISTS `+pgx.Identifier{publication}.Sanitize()); err != nil {
		return droppedSlot, false, fmt.Errorf("dropping publication %s: %w", publication, err)
	}
	return droppedSlot, true, nil
}
