package pipelinetest

import (
	"context"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// LedgerRow is a message a consumer processed, as the ledger records it,
// written by a test without SQL over the ledger's table.
type LedgerRow struct {
	Consumer  string
	MessageID string
	// ProcessedAt, if set, is when; default now. The row goes into that
	// week's partition, unless Part is set (-1: the legacy partition).
	ProcessedAt time.Time
	Part        *int
}

// InsertLedger writes rows into the ledger (pgledger.DefaultTable).
func InsertLedger(t testing.TB, q RowWriter, rows ...LedgerRow) {
	t.Helper()
	for i, r := range rows {
		var ignored int
		err := q.QueryRow(context.Background(), `INSERT INTO `+pgledger.DefaultTable+` (consumer, message_id, processed_at, part)
			VALUES ($1, $2, coalesce($3, now()), coalesce($4, ferry_outbox_part(coalesce($3, now())))) RETURNING 1`,
			r.Consumer, r.MessageID, timeOrNil(r.ProcessedAt), r.Part).Scan(&ignored)
		if err != nil {
			t.Fatalf("pipelinetest.InsertLedger: row %d: %v", i, err)
		}
	}
}

// Unprocessed returns the ids of messageIDs that consumer has not
// processed, as the ledger reads them.
func Unprocessed(t testing.TB, pool *pgxpool.Pool, consumer string, messageIDs ...string) []string {
	t.Helper()
	l, err := pgledger.New(pool, pgledger.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	left, err := l.Unprocessed(context.Background(), consumer, messageIDs)
	if err != nil {
		t.Fatalf("pipelinetest.Unprocessed: %v", err)
	}
	return left
}
