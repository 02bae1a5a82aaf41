package bench

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgconfirm"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// ScenarioPoisonDiscard times an operator's discard of an outage's give-ups
// as the console runs it, from the click that previews it to the result:
// PoisonDiscardRows messages poisoned with one reason (written through the
// poison store's own publisher, as the consumers write them), selected by
// the filter the console offers (their handler and a word of the reason),
// the preview's ids kept under a confirmation (pgconfirm), then the
// confirmed discard of exactly those ids (DiscardEach: archived in pages,
// each audited in its own transaction).
const ScenarioPoisonDiscard = "poison_discard"

// PoisonDiscardRows is how many messages the discard takes: issue 48's
// "200,000 messages discard from click to result in ≤ 10 s".
const PoisonDiscardRows = 200_000

func benchPoisonDiscard(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	sch, err := newBenchSchema(ctx, cfg, 8)
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	rows := bc.DiscardRows
	pub, err := pgpoison.NewPublisher(sch.db)
	if err != nil {
		return benchReport{}, err
	}
	seedStart := time.Now()
	// Batches of 2,000: 14 parameters a message stay under PostgreSQL's
	// 65,535 a statement.
	for done := 0; done < rows; {
		n := min(2000, rows-done)
		msgs := make(message.Messages, n)
		for i := range msgs {
			m := message.NewMessage(fmt.Sprintf("bench-poison-%d", done+i), []byte(`{"order_id":"`+strconv.Itoa(done+i)+`","amount":1250}`))
			m.Metadata.Set(wmw.PoisonedTopicKey, "payments.charge")
			m.Metadata.Set(wmw.PoisonedHandlerKey, "payments.charge")
			m.Metadata.Set(wmw.ReasonForPoisonedKey, "gave up after 6 attempts: charging order "+strconv.Itoa(done+i)+": provider answered 503")
			m.Metadata.Set(pipeline.MetaAggregateID, "order-"+strconv.Itoa(done+i))
			msgs[i] = m
		}
		if err := pub.Publish("ferry.poison", msgs...); err != nil {
			return benchReport{}, fmt.Errorf("seeding the poison store: %w", err)
		}
		done += n
	}
	seeded := time.Since(seedStart)
	if _, err := sch.pool.Exec(ctx, "ANALYZE"); err != nil {
		return benchReport{}, err
	}

	ob, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return benchReport{}, err
	}
	store, err := pgpoison.NewStore(sch.pool, ob)
	if err != nil {
		return benchReport{}, err
	}
	sel := pgpoison.Selector{Filter: pgpoison.Filter{Handler: "payments.charge", Text: "503"}}
	start := time.Now()
	ids, total, err := store.SelectIDs(ctx, sel, rows)
	if err != nil {
		return benchReport{}, fmt.Errorf("preview: %w", err)
	}
	nonce, _, err := pgconfirm.Save(ctx, sch.pool, pgconfirm.Preview{Kind: "poison", Action: "discard", Selection: sel.Scope(), IDs: ids, Total: total}, 10*time.Minute)
	if err != nil {
		return benchReport{}, fmt.Errorf("keeping the preview: %w", err)
	}
	previewed := time.Since(start)
	clicked := time.Now()
	shown, err := pgconfirm.Load(ctx, sch.pool, nonce)
	if err != nil {
		return benchReport{}, fmt.Errorf("the click: %w", err)
	}
	sum, err := store.DiscardEach(ctx, pgpoison.Selector{IDs: shown.IDs}, pgpoison.Run{Actor: "bench", Scope: sel.Scope(), Confirmation: nonce}, func(pgpoison.Action) error { return nil })
	if err != nil {
		return benchReport{}, fmt.Errorf("discard: %w", err)
	}
	acted := time.Since(clicked)
	if sum.Done != rows {
		return benchReport{}, fmt.Errorf("discarded %d of %d", sum.Done, rows)
	}
	left, err := store.Count(ctx, pgpoison.Filter{})
	if err != nil {
		return benchReport{}, err
	}
	if left != 0 {
		return benchReport{}, fmt.Errorf("%d messages left in the store after the discard", left)
	}
	clickToResult := previewed + acted
	table := fmt.Sprintf("%d poisoned messages (seeded in %s)\n  preview (select ids, keep them): %s\n  click to result (discard, archived and audited in pages): %s\n  preview + action: %s (target ≤ 10 s)\n",
		rows, seeded.Round(time.Millisecond), previewed.Round(time.Millisecond), acted.Round(time.Millisecond), clickToResult.Round(time.Millisecond))
	return benchReport{JSON: map[string]any{
		"rows": rows, "seed_seconds": seeded.Seconds(), "preview_seconds": previewed.Seconds(),
		"action_seconds": acted.Seconds(), "total_seconds": clickToResult.Seconds(), "target_seconds": 10,
	}, Table: table}, nil
}
