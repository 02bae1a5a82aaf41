package app_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// With FERRY_DATABASE_SCHEMA set, a service publishes from its own pool
// (default search_path, which does not hold that schema) in its own
// transaction: the outbox is named with its schema.
func TestServicePoolPublishesIntoTheConfiguredSchema(t *testing.T) {
	ctx := context.Background()
	schema := pipelinetest.Schema(t)
	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), DatabaseSchema: schema, AdminAddr: "off", Relay: pgoutbox.RelayConfig{Table: testTable}}
	none := func(app.Deps) ([]handlers.Route, error) { return nil, nil }
	a, err := app.New(ctx, cfg, app.Options{Migrate: true, WithoutBroker: true, Routes: none})
	require.NoError(t, err)
	defer a.Close()

	own, err := pgxpool.New(ctx, pipelinetest.DatabaseURL())
	require.NoError(t, err)
	defer own.Close()
	msg, err := pipeline.NewEvent(ctx, "order-1", map[string]string{"id": "order-1"})
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, own, func(tx pgx.Tx) error {
		return a.Outbox().PublishTx(ctx, pgoutbox.PgxTx(tx), "orders.placed", []*message.Message{msg}...)
	}))
	var corr string
	require.NoError(t, own.QueryRow(ctx, `SELECT headers->>$2 FROM `+pgx.Identifier{schema, testTable.BaseName()}.Sanitize()+` WHERE message_uuid = $1`,
		msg.UUID, pipeline.MetaCorrelationID).Scan(&corr))
	require.Equal(t, msg.UUID, corr, "an event published without a correlation id gets its own id as one, so every handler shares it")
}
