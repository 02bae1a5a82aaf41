package snippets_test

import (
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/snippets"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
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

// snippet:begin evolve-test
// The golden corpus (testdata/events/<topic>/<version>/*.json, one sample
// per version at least) decodes as the current type, and so does every
// version a staging database holds.
func TestStoredEventsStillDecode(t *testing.T) {
	ferrytest.RequireCorpusDecodes(t, "testdata/events", snippets.OrderPlacedEvents)
	if url := os.Getenv("STAGING_DATABASE_URL"); url != "" {
		pool, err := pgxpool.New(t.Context(), url)
		require.NoError(t, err)
		defer pool.Close()
		ferrytest.RequireStoredEventsDecode(t, pool, pgoutbox.Table{}, snippets.OrderPlacedEvents)
	}
}

// snippet:end evolve-test
