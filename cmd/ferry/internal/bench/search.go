package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// ScenarioSearchLoad measures what operators searching in an incident cost
// the consumers: a consumer process drains a queue while nobody searches,
// then while SearchClients operators search ("find a message", the
// console's pgstatus.Find, through the console's cap on searches at once:
// one over the cap is answered 429 and tries again after its Retry-After)
// for ids the outbox does not hold, the search that reads the most, over an
// outbox of SearchRows dispatched rows. Issue 48: 20 searches on 10
// million rows leave the consumers' rate ≥ 0.9× of none.
const ScenarioSearchLoad = "search_load"

// SearchClients is how many operators search at once, each searching
// again SearchThink after its answer (or after a 429's Retry-After).
const SearchClients = 20

// SearchThink is an operator's pause between an answer and the next
// search: reading what came back. Without it each of the 20 searches in a
// loop, which no operator does.
const SearchThink = time.Second

func benchSearchLoad(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	p, err := newBenchPipeline(ctx, cfg, bc, 8)
	if err != nil {
		return benchReport{}, err
	}
	defer p.drop()
	n := bc.ConsumerEvents
	// Both rounds' messages in the queue first (the fill empties the
	// outbox), then the history the searches read.
	if err := fillQueue(ctx, p, bc, logger, 2*n); err != nil {
		return benchReport{}, err
	}
	loadStart := time.Now()
	for done := 0; done < bc.SearchRows; done += 1_000_000 {
		k := min(1_000_000, bc.SearchRows-done)
		if _, err := p.sch.pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, headers, message_uuid, created_at, available_at, dispatched_at, attempts)
			SELECT 'order-' || g, $1, jsonb_build_object('order_id', g, 'amount', 1250),
			       jsonb_build_object('schema_version', '1', 'correlation_id', md5(g::text)), gen_random_uuid()::text,
			       now() - interval '1 day', now() - interval '1 day', now() - interval '1 day', 1
			FROM generate_series($2::int, $3::int) g`, benchTopic, done+1, done+k); err != nil {
			return benchReport{}, fmt.Errorf("loading the searched history: %w", err)
		}
	}
	if _, err := p.sch.pool.Exec(ctx, `VACUUM ANALYZE `+outboxSQL); err != nil {
		return benchReport{}, err
	}
	loaded := time.Since(loadStart)

	alone, err := drainWithConsumer(ctx, p.sch, bc, p.env, n, "consume")
	if err != nil {
		return benchReport{}, fmt.Errorf("without searches: %w", err)
	}
	// The operators: each searches, waits out a 429's Retry-After (2 s),
	// searches again, until the drain is over.
	slots := make(chan struct{}, console.DefaultMaxSearches)
	var searches, refused, slow atomic.Int64
	var lat latencies
	var latMu sync.Mutex
	sctx, stopSearches := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range SearchClients {
		wg.Go(func() {
			for sctx.Err() == nil {
				select {
				case slots <- struct{}{}:
				default:
					refused.Add(1)
					select {
					case <-sctx.Done():
					case <-time.After(2 * time.Second):
					}
					continue
				}
				start := time.Now()
				found, err := pgstatus.Find(sctx, p.sch.pool, pgoutbox.Table{}, []string{memoryQueue}, watermill.NewUUID(), 50)
				took := time.Since(start)
				<-slots
				if errors.Is(err, context.Canceled) || sctx.Err() != nil {
					return
				}
				if err == nil {
					searches.Add(1)
					if len(found.NotSearched) > 0 {
						slow.Add(1)
					}
					latMu.Lock()
					lat = append(lat, took)
					latMu.Unlock()
				}
				select {
				case <-sctx.Done():
				case <-time.After(SearchThink):
				}
			}
		})
	}
	searched, err := drainWithConsumer(ctx, p.sch, bc, p.env, 2*n, "consume")
	stopSearches()
	wg.Wait()
	if err != nil {
		return benchReport{}, fmt.Errorf("with searches: %w", err)
	}
	rateAlone, rateSearched := float64(n)/alone.seconds, float64(n)/searched.seconds
	ratio := rateSearched / rateAlone
	sum := lat.summary()
	table := fmt.Sprintf("outbox of %d dispatched rows (loaded in %s); %d operators searching for ids it does not hold, %d at once (the console's cap), each again %s after its answer\n"+
		"  consumer alone: %.0f messages/s; while searched: %.0f messages/s: %.2fx (target ≥ 0.9x)\n"+
		"  searches: %d done (p50 %.0f ms, p99 %.0f ms), %d cut by the %s timeout, %d answered 429\n",
		bc.SearchRows, loaded.Round(time.Second), SearchClients, console.DefaultMaxSearches, SearchThink, rateAlone, rateSearched, ratio,
		searches.Load(), sum["p50_ms"], sum["p99_ms"], slow.Load(), pgstatus.FindTimeout, refused.Load())
	return benchReport{JSON: map[string]any{
		"rows": bc.SearchRows, "messages": n, "clients": SearchClients, "max_searches": console.DefaultMaxSearches, "think_seconds": SearchThink.Seconds(),
		"messages_per_second_alone": rateAlone, "messages_per_second_searched": rateSearched, "ratio": ratio,
		"searches": searches.Load(), "searches_timed_out": slow.Load(), "refused_429": refused.Load(), "search_latency": sum,
		"targets": map[string]any{"ratio_min": 0.9, "met": ratio >= 0.9},
	}, Table: table}, nil
}
