package snippets_test

import (
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
)

// snippet:begin ferrytest
// requireIssued is what a service's test asserts with ferrytest.
func requireIssued(t *testing.T, tx *sql.Tx, pool *pgxpool.Pool, routes []handlers.Route, msg *message.Message, ledger middleware.Ledger) {
	// the transaction published it (its own uncommitted rows included); the payload contains these fields
	ferrytest.RequirePublishedTx(t, tx, "invoice.issued", map[string]any{"customer": "bob"})
	// every event on the routes' topics handled (ledger) or poisoned, the outbox drained
	ferrytest.RequireHandled(t, pool, routes, 30*time.Second)
	// one route's handler, inside its own middleware, on a Watermill router; optionally with the real ledger
	err := ferrytest.RunRoute(t, routes[0], msg, ferrytest.RunConfig{Ledger: ledger})
	require.NoError(t, err)
}

// snippet:end ferrytest

var _ = requireIssued
