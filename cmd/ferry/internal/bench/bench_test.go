package bench_test

import (
	"bufio"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/cmd/ferry/internal/bench"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The benchmark command, at toy sizes: every scenario runs, prints one JSON
// object with its named fields, and the numbers are sane. The targets are
// judged by `ferry bench` at full size, not here.
func TestBenchSmoke(t *testing.T) {
	rmq := pipelinetest.Rabbit(t)
	pipelinetest.RequireLogicalWAL(t) // its relay modes include cdc
	cfg := app.Config{DatabaseURL: pipelinetest.DatabaseURL(), AMQP: rmq}
	// The memory scenario starts relay and consumer processes of the ferry binary.
	bin := filepath.Join(t.TempDir(), "ferry")
	build, err := exec.Command("go", "build", "-o", bin, "github.com/ferry-dev/ferry/cmd/ferry").CombinedOutput()
	require.NoError(t, err, "building ferry: %s", build)
	var out, human strings.Builder
	profile := filepath.Join(t.TempDir(), "cpu")
	serverLog := filepath.Join(t.TempDir(), "server.log")
	err = bench.Bench(context.Background(), cfg, bench.BenchConfig{
		Events: 600, BaselineEvents: 100, Relays: []int{1, 2}, Rate: 200, Duration: time.Second,
		Orders: 40, History: []int{100, 3000}, ClaimRounds: 10, Binary: bin, RelayModes: []string{app.RelayModeCDC},
		CPUProfile: profile, Writers: []int{2}, Rounds: 1, ProducerDuration: 300 * time.Millisecond,
		ConsumerEvents: 300, DrainEvents: 300, UpcastIterations: 50, HeldXminEvents: 500, HeldXminRounds: 2, DiscardRows: 2500, SearchRows: 20_000,
		HeldXminRelayOnly: true, // end_to_end_latency runs the whole app
		// Toy tenants: a hundred schemas and a million-event backlog (the
		// defaults) took most of this test's time.
		Tenants: 4, TenantBacklog: 2000,
		// A prefix with spaces and shell characters must reach the server whole.
		ServerSettings: []string{"log_line_prefix=%m [%p] |x| ", "log_autovacuum_min_duration=0"}, ServerLog: serverLog,
	}, &out, &human, slog.New(slog.DiscardHandler))
	require.NoError(t, err, human.String())

	got := map[string]map[string]any{}
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	for sc.Scan() {
		var obj map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &obj), sc.Text())
		got[obj["scenario"].(string)] = obj
	}
	require.Len(t, got, len(bench.BenchScenarios))

	tn := got[bench.ScenarioTenants]
	require.EqualValues(t, 4, tn["tenants"])
	require.EqualValues(t, 2000, tn["backlog"])
	require.Positive(t, tn["quiet_alone"].(map[string]any)["p99_ms"], "the quiet tenants' effects were measured")
	require.Zero(t, tn["handler_errors"])

	rt := got[bench.ScenarioRelayThroughput]
	runs := rt["runs"].([]any)
	require.Len(t, runs, 2)
	for _, r := range runs {
		run := r.(map[string]any)
		require.EqualValues(t, 600, run["messages_at_broker"], "every event reached the broker")
		require.Positive(t, run["events_per_sec"].(float64))
		require.Positive(t, run["ratio_vs_baseline"].(float64))
		require.Positive(t, run["ratio_vs_lower_raw_limit"].(float64))
	}
	require.EqualValues(t, 100, rt["baseline"].(map[string]any)["forwarded"])
	cdcRun := rt["cdc"].(map[string]any)["run"].(map[string]any)
	require.EqualValues(t, 600, cdcRun["messages_at_broker"], "the CDC relay's run: every event reached the broker")
	require.Positive(t, rt["cdc"].(map[string]any)["ratio_vs_notify_1_relay"].(float64))

	e2e := got[bench.ScenarioEndToEnd]
	require.EqualValues(t, 200, e2e["handled"])
	require.EqualValues(t, 200, e2e["commit_to_handler"].(map[string]any)["count"])
	require.EqualValues(t, 200, e2e["commit_to_effect"].(map[string]any)["count"], "every effect recorded, timed")
	require.Positive(t, e2e["cpu_us_per_event"].(map[string]any)["postgresql"].(float64), "the database's CPU per event")
	batchE2E := e2e["batch"].(map[string]any)
	require.EqualValues(t, 200, batchE2E["handled"], "the batch route's end-to-end run")
	require.EqualValues(t, 200, batchE2E["commit_to_effect"].(map[string]any)["count"])
	require.Equal(t, true, batchE2E["params"].(map[string]any)["batch_route"])
	require.Contains(t, e2e["targets"], "commit_to_confirm_p99_met")
	for _, variant := range []string{"readme", "readme_probe_off"} {
		readme := e2e[variant].(map[string]any)
		require.EqualValues(t, 50, readme["handled"], "published as the README does (%s): every event handled", variant)
		require.EqualValues(t, 50, readme["commit_to_confirm"].(map[string]any)["count"])
	}
	require.EqualValues(t, 10, e2e["readme"].(map[string]any)["params"].(map[string]any)["probe_interval_ms"])
	cdcE2E := e2e["cdc"].(map[string]any)
	require.EqualValues(t, 200, cdcE2E["handled"], "the CDC relay's end-to-end run")
	require.EqualValues(t, 200, cdcE2E["cdc_streamer"].(map[string]any)["dispatched"], "every event went by the stream: %v", cdcE2E["cdc_streamer"])
	require.Equal(t, "cdc", cdcE2E["params"].(map[string]any)["relay_mode"])

	wo := got[bench.ScenarioWriteOverhead]
	require.Greater(t, wo["ratio_p50"].(float64), 1.0, "events cost something")
	require.Positive(t, wo["in_tx_ratio_p50"].(float64))
	require.Contains(t, wo, "in_tx_without_events")
	require.Positive(t, wo["in_tx_events_ratio_p50"].(float64))

	pc := got[bench.ScenarioProducerConcurrency]
	w2 := pc["writers_2"].(map[string]any)
	for _, k := range []string{"no_wakeup_tps", "waker_tps", "watch_tps", "trigger_tps"} {
		require.Positive(t, w2[k].([]any)[0].(float64), k)
	}
	require.EqualValues(t, 300, pc["idle_commit_to_publish"].(map[string]any)["count"], "every idle commit reached the broker, woken")
	require.Positive(t, pc["notifications_received"].(float64), "the waker's and the trigger's notifications arrived")

	ct := got[bench.ScenarioConsumerThroughput]
	require.Positive(t, ct["cpu_us_per_message"].(float64), "CPU per consumed message")
	require.Positive(t, ct["messages_per_second"].(float64))
	require.Positive(t, ct["peak_rss_bytes"].(float64))
	ctBatch := ct["batch"].(map[string]any)
	require.Positive(t, ctBatch["cpu_us_per_message"].(float64), "CPU per message of the batch route")
	require.Positive(t, ctBatch["messages_per_second"].(float64))
	dr := got[bench.ScenarioEndToEndDrain]
	require.Positive(t, dr["effects_per_second"].(float64), "effects/s end to end")
	require.Positive(t, dr["batch"].(map[string]any)["effects_per_second"].(float64), "effects/s end to end, batch route")
	require.Positive(t, dr["machine_cpu_us_per_effect"].(map[string]any)["all"].(float64), "the machine's CPU per effect")
	require.EqualValues(t, 300, dr["params"].(map[string]any)["transactions"])

	cc := got[bench.ScenarioClaimCost]
	require.Len(t, cc["runs"].([]any), 2)
	require.Contains(t, cc, "ratio_p50_largest_vs_smallest")
	require.Contains(t, human.String(), "== relay_throughput")

	hx := got[bench.ScenarioHeldXmin]
	require.Len(t, hx["with_long_tx"].([]any), 2)
	require.Len(t, hx["without_long_tx"].([]any), 2)
	require.Positive(t, hx["last_over_first_held"].(float64))
	require.Contains(t, hx["server_settings"].([]any), "autovacuum=on", "a bench about bloat runs with production's vacuum")
	// The relay sends rows at their first try without writing to them: a
	// held horizon leaves no dead row version per event (before migration
	// 00024, one per dispatch).
	require.Zero(t, hx["dead_tuples_per_event"].(float64))
	// Retention with the horizon held: a week's partition goes by TRUNCATE
	// without a dead tuple; the legacy partition's DELETE leaves one per row.
	ret := hx["retention_held"].(map[string]any)
	require.EqualValues(t, 500, ret["rows_each"])
	require.Zero(t, ret["truncate_dead_tuples"].(float64))
	require.EqualValues(t, 500, ret["delete_dead_tuples"], "a held horizon keeps each row DELETE removed")
	// The CDC relay's rounds (--relay-mode cdc): it still marks each row
	// it sends, so a held horizon keeps a dead version per event.
	hc := hx["cdc"].(map[string]any)
	require.Len(t, hc["with_long_tx"].([]any), 2)
	require.Len(t, hc["without_long_tx"].([]any), 2)
	require.InDelta(t, 1.0, hc["dead_tuples_per_event"].(float64), 0.01, "the CDC relay's UPDATE per row, kept by the held horizon")

	hs := got[bench.ScenarioHeldXminSteady]
	require.Equal(t, true, hs["kept_up"], "every event confirmed, with and without a long transaction: confirmed/handled %v/%v without, %v/%v with",
		hs["without_long_tx"].(map[string]any)["commit_to_confirm"].(map[string]any)["count"], hs["without_long_tx"].(map[string]any)["handled"],
		hs["with_long_tx"].(map[string]any)["commit_to_confirm"].(map[string]any)["count"], hs["with_long_tx"].(map[string]any)["handled"])
	require.Positive(t, hs["commit_to_confirm_p99_ratio"].(float64))
	require.Equal(t, true, hs["relay_only"])
	require.Contains(t, hs["server_settings"], "log_autovacuum_min_duration=0")
	kept, err := os.ReadFile(serverLog)
	require.NoError(t, err)
	for _, sc := range []string{bench.ScenarioHeldXmin, bench.ScenarioHeldXminSteady} {
		require.Contains(t, string(kept), "== "+sc+": PostgreSQL server log, settings ", "each own server's log kept")
	}
	require.Regexp(t, `(?m)^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \S+ \[\d+\] \|x\| LOG: `, string(kept), "the servers logged with the prefix given")

	sl := got[bench.ScenarioSearchLoad]
	require.Positive(t, sl["messages_per_second_alone"].(float64))
	require.Positive(t, sl["messages_per_second_searched"].(float64))
	require.Positive(t, sl["searches"].(float64), "the operators searched while the consumer drained")

	pd := got[bench.ScenarioPoisonDiscard]
	require.Equal(t, 2500.0, pd["rows"], "every seeded message discarded (the scenario fails otherwise)")
	require.Positive(t, pd["action_seconds"].(float64))

	up := got[bench.ScenarioUpcast]
	require.GreaterOrEqual(t, up["payload_bytes"].(float64), 1024.0)
	require.Positive(t, up["decode_current_us"].(float64))
	require.Positive(t, up["decode_two_raw_us"].(float64))

	mem := got[bench.ScenarioMemory]
	require.Positive(t, mem["relay_peak_rss_bytes"].(float64), "peak RSS of a relay process")
	require.Len(t, mem["relay_peak_rss_each"].([]any), 4)
	require.Positive(t, mem["consumer_peak_rss_bytes"].(float64), "peak RSS of a consumer process")
	require.Positive(t, mem["relay_cpu_us_per_event"].(float64), "CPU per relayed event")
	require.Positive(t, mem["consumer_cpu_us_per_event"].(float64), "CPU per consumed event")
	// memory: 4 relays and a consumer; consumer_throughput: a consumer of
	// each kind; end_to_end_drain: a relay and a consumer, twice;
	// search_load: a consumer, twice.
	for kind, n := range map[string]int{"relay": 6, "consume": 5, "consume-batch": 2} {
		files, err := filepath.Glob(profile + "." + kind + ".*")
		require.NoError(t, err)
		require.Len(t, files, n, "a CPU profile per %s process", kind)
		for _, f := range files {
			st, err := os.Stat(f)
			require.NoError(t, err)
			require.Positive(t, st.Size(), "%s is written", f)
		}
	}
}

func TestBenchRejectsBadParameters(t *testing.T) {
	t.Parallel()
	err := bench.Bench(context.Background(), app.Config{}, bench.BenchConfig{Scenarios: []string{"nope"}, Relays: []int{0}}, nil, nil, nil)
	require.ErrorContains(t, err, `unknown scenario "nope"`)
	require.ErrorContains(t, err, "relay count 0")
}
