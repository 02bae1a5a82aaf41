package chaos_test

import (
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/internal/chaos"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline/pipelinetest"
)

// The short chaos run (CI): 2,000 orders through create_order while relay
// and consumer processes of the real binary are SIGKILLed and restarted,
// their database backends terminated and their broker connections cut, and
// handlers fail (10%) and panic (1%) at random. `ferry chaos --long` is the
// long run.
func TestChaosShort(t *testing.T) {
	rmq := pipelinetest.Rabbit(t)
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Fatalf("the chaos run needs rabbitmqctl on PATH: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "ferry")
	build := exec.Command("go", "build", "-o", bin, "github.com/ferry-dev/ferry/cmd/ferry")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)

	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), AMQP: rmq}
	var report strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := chaos.Chaos(ctx, cfg, chaos.ChaosRun{Orders: 2000, Rate: 400, FaultEvery: 250 * time.Millisecond, Seed: 42, Binary: bin},
		&report, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Log("\n" + report.String())
	require.True(t, rep.OK(), report.String())
	require.GreaterOrEqual(t, rep.OrdersCommitted, 1800)
	require.Positive(t, rep.OrdersRolledBack)
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Equal(t, rep.OrdersCommitted, rep.AuditEvents)
	for _, kind := range []string{"kill_relay", "kill_consumer", "terminate_db_backends", "close_amqp_connections"} {
		require.Positive(t, rep.Faults[kind], "fault %s never injected", kind)
	}
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
}

// The CDC variant of the short run: the two relay processes stream from
// one replication slot (one active, one standing by, taking over when the
// other is killed), the walsender's backend is among those terminated, and
// the invariants are the same: nothing lost, nothing twice, order intact.
func TestChaosShortCDC(t *testing.T) {
	rmq := pipelinetest.Rabbit(t)
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Fatalf("the chaos run needs rabbitmqctl on PATH: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "ferry")
	build := exec.Command("go", "build", "-o", bin, "github.com/ferry-dev/ferry/cmd/ferry")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building ferry: %s", out)

	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), AMQP: rmq}
	var report strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := chaos.Chaos(ctx, cfg, chaos.ChaosRun{Orders: 2000, Rate: 400, FaultEvery: 250 * time.Millisecond, Seed: 42, Binary: bin, RelayMode: app.RelayModeCDC},
		&report, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Log("\n" + report.String())
	require.True(t, rep.OK(), report.String())
	require.Equal(t, app.RelayModeCDC, rep.RelayMode)
	require.GreaterOrEqual(t, rep.OrdersCommitted, 1800)
	require.Equal(t, rep.OrdersCommitted, rep.Charges)
	require.Equal(t, rep.OrdersCommitted, rep.Mails)
	require.Equal(t, rep.OrdersCommitted, rep.AuditEvents)
	for _, kind := range []string{"kill_relay", "kill_consumer", "terminate_db_backends", "close_amqp_connections"} {
		require.Positive(t, rep.Faults[kind], "fault %s never injected", kind)
	}
	require.Zero(t, rep.Lost)
	require.Zero(t, rep.Duplicated)
	require.Zero(t, rep.OrderViolations)
}
