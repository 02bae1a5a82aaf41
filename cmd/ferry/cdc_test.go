package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/cli"
	"github.com/ferry-dev/ferry/metrics"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// `ferry relay --mode cdc` end to end through the CLI: the relay creates
// its slot and publication and streams a committed row to the broker;
// `ferry status` shows the slot, the metrics report it, `ferry cdc drop`
// refuses while the slot is streamed and removes slot and publication once
// the relay stopped, after which status calls for a human.
func TestRelayModeCDCCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and RabbitMQ; skipped with -short")
	}
	pipelinetest.RequireLogicalWAL(t)
	pipelinetest.Rabbit(t)
	vhost := ownVhost(t, "ferry_test_cdc_")

	schema := pipelinetest.Schema(t)
	slot := "ferry_test_cli_" + strings.TrimPrefix(schema, "ferry_test_")
	t.Setenv("FERRY_DATABASE_URL", pipelinetest.DatabaseURL())
	t.Setenv("FERRY_DATABASE_SCHEMA", schema)
	t.Setenv("FERRY_AMQP_URL", pipelinetest.AMQPURLWithVhost(t, vhost))
	t.Setenv("FERRY_ADMIN_ADDR", "off")
	t.Setenv("FERRY_HTTP_ADDR", "127.0.0.1:0")
	t.Setenv("FERRY_LOG_LEVEL", "warn")
	t.Setenv("FERRY_RELAY_MODE", "cdc")
	t.Setenv("FERRY_CDC_SLOT", slot)
	pool := pipelinetest.Pool(t, schema, "ferry-test-cli-cdc")
	t.Cleanup(func() {
		// Whatever the test did, the slot must not outlive it.
		_, _ = pool.Exec(context.Background(), `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active`, slot)
		_, _ = pool.Exec(context.Background(), `DROP PUBLICATION IF EXISTS `+slot)
	})
	cmd := func(args ...string) (int, string, string) {
		var out, errOut strings.Builder
		code := run(args, &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, _, errOut := cmd("relay", "--mode", "sideways")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "--mode must be notify, poll or cdc")

	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan int, 1)
	relayErr := &pipelinetest.SyncBuffer{}
	go func() {
		relayDone <- cli.New(options()).Run(ctx, []string{"relay", "--mode", "cdc", "--migrate"}, &strings.Builder{}, relayErr)
	}()
	stopRelay := func() {
		cancel()
		select {
		case code := <-relayDone:
			require.Equal(t, 0, code, relayErr.String())
		case <-time.After(30 * time.Second):
			t.Fatal("the relay did not stop")
		}
	}
	defer func() {
		if ctx.Err() == nil {
			stopRelay()
		}
	}()
	require.Eventually(t, func() bool {
		var active bool
		_ = pool.QueryRow(context.Background(), `SELECT active AND confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&active)
		return active
	}, 30*time.Second, 50*time.Millisecond, "the CDC relay never streamed its slot: %s", relayErr.String())

	id := pipelinetest.InsertOutbox(t, pool, pgoutbox.Table{}, pipelinetest.OutboxRow{AggregateID: "a-1", Topic: "cdc.cli", Payload: `{"n":1}`})[0]
	require.Eventually(t, func() bool {
		rows, _ := pgoutbox.Table{}.Rows(context.Background(), pool, pgoutbox.RowFilter{IDs: []int64{id}})
		return len(rows) == 1 && rows[0].Dispatched
	}, 20*time.Second, 20*time.Millisecond, "the streamed row was never dispatched: %s", relayErr.String())

	code, out, errOut := cmd("status", "--json", "--exit-code=false")
	require.Equal(t, 0, code, errOut)
	var rep struct {
		CDC *struct {
			Name         string `json:"name"`
			Exists       bool   `json:"exists"`
			Active       bool   `json:"active"`
			ConfirmedLSN string `json:"confirmed_lsn"`
		} `json:"cdc"`
		Attention []string `json:"attention"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	require.NotNil(t, rep.CDC, out)
	require.Equal(t, slot, rep.CDC.Name)
	require.True(t, rep.CDC.Exists && rep.CDC.Active, out)
	require.NotEmpty(t, rep.CDC.ConfirmedLSN)
	code, out, _ = cmd("status", "--exit-code=false")
	require.Equal(t, 0, code)
	require.Contains(t, out, "cdc slot "+slot+": streamed by walsender pid")

	m := metrics.New()
	m.CDCSlot = slot
	require.NoError(t, m.Refresh(context.Background(), pool))
	families, err := m.Registry.Gather()
	require.NoError(t, err)
	values := map[string]float64{}
	for _, f := range families {
		if strings.HasPrefix(f.GetName(), "ferry_cdc_") && len(f.GetMetric()) == 1 {
			values[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	require.Equal(t, 1.0, values["ferry_cdc_slot_active"])
	require.Positive(t, values["ferry_cdc_confirmed_lsn"])
	require.Contains(t, values, "ferry_cdc_retained_wal_bytes")
	require.Contains(t, values, "ferry_cdc_slot_lag_bytes")

	code, _, errOut = cmd("cdc", "drop")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "stop the CDC relay first")

	stopRelay()
	require.Eventually(t, func() bool {
		code, _, _ := cmd("cdc", "drop")
		return code == 0
	}, 20*time.Second, 100*time.Millisecond, "cdc drop never succeeded after the relay stopped")
	var slots, pubs int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1), (SELECT count(*) FROM pg_publication WHERE pubname = $1)`, slot).Scan(&slots, &pubs))
	require.Zero(t, slots+pubs, "slot and publication are gone")
	code, out, _ = cmd("cdc", "drop")
	require.Equal(t, 0, code)
	require.Contains(t, out, "not there")

	code, out, _ = cmd("status", "--json")
	require.Equal(t, cli.ExitAttention, code, out)
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	require.False(t, rep.CDC.Exists)
	require.Contains(t, strings.Join(rep.Attention, "\n"), "does not exist")
}

// On a server that cannot stream (wal_level=replica), `relay --mode cdc
// --migrate` refuses before it migrates anything: the schema stays empty.
func TestRelayModeCDCRefusesBeforeMigrating(t *testing.T) {
	pg := pipelinetest.OwnPostgres(t, "wal_level=replica")
	t.Setenv("FERRY_DATABASE_URL", pg.URL("postgres"))
	t.Setenv("FERRY_DATABASE_SCHEMA", "ferry_cdc_refused")
	t.Setenv("FERRY_AMQP_URL", pipelinetest.AMQPURL())
	t.Setenv("FERRY_AMQP_NAMESPACE", pipelinetest.UniqueName("ferrytest.")+".")
	t.Setenv("FERRY_ADMIN_ADDR", "off")
	var out, errOut strings.Builder
	require.Equal(t, 1, run([]string{"relay", "--mode", "cdc", "--migrate"}, &out, &errOut))
	require.Contains(t, errOut.String(), "wal_level")
	var schemas int
	conn, err := pgx.Connect(context.Background(), pg.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(context.Background())
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_namespace WHERE nspname = 'ferry_cdc_refused'`).Scan(&schemas))
	require.Zero(t, schemas, "nothing was migrated")
}
