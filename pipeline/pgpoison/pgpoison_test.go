package pgpoison_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func poisoned(id, topic string, payload string) *message.Message {
	m := message.NewMessage(id, []byte(payload))
	m.Metadata.Set(wmw.ReasonForPoisonedKey, "boom")
	m.Metadata.Set(wmw.PoisonedTopicKey, topic)
	m.Metadata.Set(wmw.PoisonedHandlerKey, "h")
	m.Metadata.Set(pipeline.MetaAttempt, "4")
	m.Metadata.Set(pipeline.MetaCorrelationID, "corr")
	m.Metadata.Set(pipeline.MetaAggregateID, "agg-"+id)
	return m
}

func TestStoreRoundTrip(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("ignored", poisoned("1", "a.topic", `{"ok":1}`), poisoned("2", "b.topic", "not json")))
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)

	all, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Len(t, all, 2)
	require.Equal(t, "boom", all[0].Reason)
	require.Equal(t, 4, all[0].Attempts)
	require.Equal(t, "corr", all[0].CorrelationID)
	require.Equal(t, "agg-1", all[0].AggregateID)
	depth, err := store.Depth(context.Background())
	require.NoError(t, err)
	require.Equal(t, map[string]int{"a.topic": 1, "b.topic": 1}, depth)

	res, err := store.Requeue(context.Background(), pgpoison.Selector{All: true}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, res.Requeued, 2, "payloads go back byte for byte, JSON or not")
	require.Empty(t, res.Skipped)

	tbl := pipelinetest.OutboxTable(t)
	back, err := tbl.Rows(context.Background(), pool, pgoutbox.RowFilter{MessageID: res.MessageIDs[0]})
	require.NoError(t, err)
	require.Len(t, back, 1)
	topic, headers := back[0].Topic, back[0].Headers
	require.Equal(t, "a.topic", topic)
	require.Equal(t, "1", headers[pipeline.MetaMessageID], "the message keeps its id")
	require.NotContains(t, headers, pipeline.MetaAttempt, "the attempt count is reset")
	require.NotContains(t, headers, wmw.ReasonForPoisonedKey)
	require.Equal(t, "corr", headers[pipeline.MetaCorrelationID])

	back, err = tbl.Rows(context.Background(), pool, pgoutbox.RowFilter{Topic: "b.topic"})
	require.NoError(t, err)
	require.Len(t, back, 1)
	require.Equal(t, all[1].Payload, back[0].Payload, "the non-JSON payload is back in the outbox byte for byte")

	left, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Empty(t, left)
	require.Error(t, pgpoison.Selector{}.Validate())
	require.Error(t, pgpoison.Selector{All: true, Topic: "x"}.Validate())
}

// A message that cannot be written back is skipped with its reason and
// the rest are requeued; the dry run takes the same steps and reports the
// same; ids the store does not hold are named.
func TestRequeueSkipsWhatCannotBeStoredAndDryRunAgrees(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	noID := poisoned("", "a.topic", `{"ok":3}`) // a message that came without an id
	nul := poisoned("4", "a.topic", `{"s":"\u0000"}`)
	require.NoError(t, pub.Publish("ignored", poisoned("1", "a.topic", `{"ok":1}`), noID, poisoned("2", "a.topic", `{"ok":2}`), nul))
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	all, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Len(t, all, 4)

	dry, err := store.Requeue(context.Background(), pgpoison.Selector{Topic: "a.topic"}, pgpoison.Run{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Requeued, 3)
	require.Len(t, dry.Skipped, 1)
	require.Contains(t, dry.Skipped[0].Why, "message has no UUID")
	require.Empty(t, outboxRows(t, pool), "a dry run writes nothing")

	res, err := store.Requeue(context.Background(), pgpoison.Selector{Topic: "a.topic"}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, res.Requeued, len(dry.Requeued), "the dry run said what the real run did")
	require.Len(t, res.Skipped, 1)
	require.Equal(t, dry.Skipped[0].Record.ID, res.Skipped[0].Record.ID)
	left, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Len(t, left, 1, "the skipped message stays in the store")

	gone, err := store.Discard(context.Background(), pgpoison.Selector{IDs: []int64{left[0].ID}}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, gone, 1)
	sum, err := store.DiscardEach(context.Background(), pgpoison.Selector{IDs: []int64{left[0].ID, 999}}, pgpoison.Run{Actor: "test"}, func(pgpoison.Action) error { return nil })
	require.NoError(t, err)
	require.Equal(t, []int64{left[0].ID, 999}, sum.NotFound)
}

// Each pages by id: every record once, in order, from any starting id,
// within the limit.
func TestEachPagesByID(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	var rows []pipelinetest.PoisonRow
	for g := 1; g <= 1234; g++ {
		rows = append(rows, pipelinetest.PoisonRow{Topic: []string{"even", "odd"}[g%2], Reason: "r"})
	}
	pipelinetest.InsertPoison(t, pool, rows...)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	var ids []int64
	require.NoError(t, store.Each(context.Background(), pgpoison.Filter{}, func(r pgpoison.Record) error { ids = append(ids, r.ID); return nil }))
	require.Len(t, ids, 1234)
	for i := 1; i < len(ids); i++ {
		require.Less(t, ids[i-1], ids[i])
	}
	var page []int64
	require.NoError(t, store.Each(context.Background(), pgpoison.Filter{AfterID: ids[599], Limit: 700, Topic: "even"}, func(r pgpoison.Record) error {
		page = append(page, r.ID)
		return nil
	}))
	require.Len(t, page, 317, "the even ids after the 600th: 634 are past it, 317 of them even")
	require.Greater(t, page[0], ids[599])
	require.Error(t, pgpoison.Filter{Limit: -1}.Validate())
	require.Error(t, pgpoison.Filter{Limit: pgpoison.MaxLimit + 1}.Validate())
	require.Error(t, pgpoison.Filter{AfterID: -1}.Validate())
}

// Whatever a failure carried (a provider's Latin-1 body as the reason, a
// NUL in a header, a reason of a megabyte), the poison store takes the
// message, cleaned and bounded; and a requeue of it is written back.
func TestStoreTakesAnyTextCleaned(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	latin := poisoned("l1", "a.topic", `{"ok":1}`)
	latin.Metadata.Set(wmw.ReasonForPoisonedKey, "provider answered 400: Kunde ung\xfcltig")
	nul := poisoned("n1", "a.topic", `{"ok":2}`)
	nul.Metadata.Set("note", "a\x00b")
	nul.Metadata.Set("bad\xffkey", "v")
	nul.Metadata.Set(pipeline.MetaCorrelationID, "c\x00")
	huge := poisoned("h1", "a.topic", `{"ok":3}`)
	huge.Metadata.Set(wmw.ReasonForPoisonedKey, strings.Repeat("é", 1<<19))
	require.NoError(t, pub.Publish("ignored", latin, nul, huge))

	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	all, err := store.List(context.Background(), "", 0)
	require.NoError(t, err)
	require.Len(t, all, 3)
	byID := map[string]pgpoison.Record{}
	for _, r := range all {
		byID[r.MessageID] = r
	}
	require.Equal(t, "provider answered 400: Kunde ung\uFFFDltig", byID["l1"].Reason)
	require.Equal(t, "a\uFFFDb", byID["n1"].Headers["note"])
	require.Equal(t, "v", byID["n1"].Headers["bad\uFFFDkey"])
	require.LessOrEqual(t, len(byID["h1"].Reason), pgpoison.MaxReasonLength)
	require.True(t, utf8.ValidString(byID["h1"].Reason))

	res, err := store.Requeue(context.Background(), pgpoison.Selector{Topic: "a.topic"}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, res.Requeued, 3, "skipped: %+v", res.Skipped)
}

// Fingerprints keep what tells failures apart (a provider's decline code,
// an HTTP status, an AMQP reply code, an SMTP reply code) and normalise what does not (ids,
// counts, addresses).
func TestFingerprintsSeparateWhatDiffers(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	reasons := []string{
		`gave up after 5 attempts: charging order 12: payment provider answered 402: {"error":{"code":"card_declined","decline_code":"stolen_card"}}`,
		`gave up after 3 attempts: charging order 99: payment provider answered 402: {"error":{"code":"card_declined","decline_code":"stolen_card"}}`,
		`gave up after 5 attempts: charging order 7: payment provider answered 402: {"error":{"code":"card_declined","decline_code":"insufficient_funds"}}`,
		`charging order 1: payment provider answered 503 from 10.0.0.1`,
		`charging order 2: payment provider answered 503 from 10.0.0.2`,
		`charging order 3: payment provider answered 429 from 10.0.0.3`,
		`publishing message 5: Exception (403) Reason: "ACCESS_REFUSED - operation not permitted"`,
		`publishing message 6: Exception (406) Reason: "PRECONDITION_FAILED - inequivalent arg"`,
		// SMTP: a permanent refusal and a "try later" are different failures.
		`mailing order 1: SMTP RCPT TO: 550 5.1.1 <redacted>: mailbox unavailable`,
		`mailing order 2: SMTP RCPT TO: 550 5.1.1 <redacted>: mailbox unavailable`,
		`mailing order 3: SMTP RCPT TO: 451 4.7.1 <redacted>: try again later`,
		`mailing order 4: SMTP DATA: 552 5.3.4 message too big`,
		`mailing order 5: SMTP DATA: 452 4.3.1 insufficient storage`,
	}
	for i, r := range reasons {
		pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: fmt.Sprint(i), Reason: r})
	}
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	groups, err := store.Groups(context.Background(), pgpoison.Filter{}, 50)
	require.NoError(t, err)
	counts := map[int]int{}
	for _, g := range groups {
		counts[g.Count]++
	}
	require.Len(t, groups, 10, "stolen_card, insufficient_funds, 503, 429, 403, 406, SMTP 550, 451, 552, 452: %+v", groups)
	require.Equal(t, map[int]int{2: 3, 1: 7}, counts, "the two stolen_card declines, the two 503s and the two 550s group together")
}

// An operator's action and its audit entry commit together: the entry
// names the ids acted on, and when the audit cannot be written the action
// is undone instead of reported as failed after it happened.
func TestActionAndItsAuditCommitTogether(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("ignored", poisoned("1", "a.topic", `{}`), poisoned("2", "a.topic", `{}`), poisoned("3", "a.topic", `{}`)))
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	all, err := store.List(ctx, "", 0)
	require.NoError(t, err)

	_, err = store.Discard(ctx, pgpoison.Selector{IDs: []int64{all[0].ID}}, pgpoison.Run{})
	require.ErrorContains(t, err, "actor", "a real action names who acts")

	gone, err := store.Discard(ctx, pgpoison.Selector{IDs: []int64{all[0].ID, all[1].ID}}, pgpoison.Run{Actor: "ops@test"})
	require.NoError(t, err)
	require.Len(t, gone, 2)
	audit := pipelinetest.Audited(t, pool, "")
	require.Len(t, audit, 1)
	require.Equal(t, "ops@test", audit[0].Actor)
	require.Equal(t, "poison.discard", audit[0].Action)
	require.Equal(t, 2, audit[0].Count)
	require.Equal(t, []any{float64(all[0].ID), float64(all[1].ID)}, audit[0].Detail["ids"], "the audit keeps the ids")

	// The audit log refuses writes: the requeue is rolled back with it.
	_, err = pool.Exec(ctx, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'audit refused'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON ferry_audit_log FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)
	_, err = store.Requeue(ctx, pgpoison.Selector{All: true}, pgpoison.Run{Actor: "ops@test"})
	require.ErrorContains(t, err, "audit refused")
	left, err := store.List(ctx, "", 0)
	require.NoError(t, err)
	require.Len(t, left, 1, "the message is still poisoned: no action without its audit")
	require.Empty(t, outboxRows(t, pool), "nothing was requeued")
}

// outboxRows is every row of the test's outbox.
func outboxRows(t *testing.T, pool *pgxpool.Pool) []pgoutbox.Row {
	t.Helper()
	rows, err := pipelinetest.OutboxTable(t).Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	return rows
}

// A discard is undoable: its messages wait in the archive under the run's
// id, an undo puts that run (and only it) back with the ids, audited, a
// second undo finds nothing, and retention ends what can be undone.
func TestADiscardCanBeUndoneUntilItsRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	db := pgdb.SQLDB(pool)
	defer db.Close()
	pub, err := pgpoison.NewPublisher(db)
	require.NoError(t, err)
	for i := range 5 {
		require.NoError(t, pub.Publish("ignored", poisoned(fmt.Sprint("u", i), "a.topic", fmt.Sprintf(`{"n":%d}`, i))))
	}
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	before, err := store.List(ctx, "", 0)
	require.NoError(t, err)
	ids := []int64{before[0].ID, before[1].ID, before[2].ID}

	first, err := store.Discard(ctx, pgpoison.Selector{IDs: ids[:2]}, pgpoison.Run{Actor: "test", ID: "run-one"})
	require.NoError(t, err)
	require.Len(t, first, 2)
	sum, err := store.DiscardEach(ctx, pgpoison.Selector{IDs: ids[2:]}, pgpoison.Run{Actor: "test"}, func(pgpoison.Action) error { return nil })
	require.NoError(t, err)
	require.NotEmpty(t, sum.Run, "a run without an id gets one")
	n, err := store.Count(ctx, pgpoison.Filter{})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	archived, err := store.Archived(ctx, "run-one")
	require.NoError(t, err)
	require.Equal(t, 2, archived)
	require.Equal(t, "run-one", pipelinetest.Audited(t, pool, "poison.discard")[0].Detail["run"], "the audit entry names the run to undo")

	res, err := store.Undo(ctx, "run-one", "test")
	require.NoError(t, err)
	require.Equal(t, ids[:2], res.Restored)
	back, err := store.Get(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, before[0].Payload, back.Payload)
	require.Equal(t, before[0].Reason, back.Reason)
	require.Equal(t, before[0].Headers, back.Headers)
	require.Equal(t, before[0].Fingerprint, back.Fingerprint)
	n, err = store.Count(ctx, pgpoison.Filter{})
	require.NoError(t, err)
	require.Equal(t, 4, n, "only run-one came back")
	require.Equal(t, 2, pipelinetest.Audited(t, pool, "poison.undo")[0].Count)
	_, err = store.Undo(ctx, "run-one", "test")
	require.ErrorIs(t, err, pgpoison.ErrNothingToUndo)

	// Past retention, the other run cannot be undone; a run discarded
	// since, within retention, still can.
	_, err = pool.Exec(ctx, `UPDATE ferry_poison_archive SET discarded_at = now() - interval '15 days'`)
	require.NoError(t, err)
	young, err := store.Discard(ctx, pgpoison.Selector{IDs: ids[:1]}, pgpoison.Run{Actor: "test", ID: "run-young"})
	require.NoError(t, err)
	require.Len(t, young, 1)
	res2, err := pgretention.Prune(ctx, pool, pgretention.PoisonArchive, pgretention.Options{OlderThan: pgretention.DefaultPoisonArchiveRetention})
	require.NoError(t, err)
	require.EqualValues(t, 1, res2.Removed, "only the run past retention")
	_, err = store.Undo(ctx, sum.Run, "test")
	require.ErrorIs(t, err, pgpoison.ErrNothingToUndo)
	kept, err := store.Undo(ctx, "run-young", "test")
	require.NoError(t, err, "a run within retention can still be undone")
	require.Equal(t, ids[:1], kept.Restored)
}

// An undo pages as a discard does: each page of 500 in its own
// transaction with its own audit entry, which records how many and the
// run, not every id (a run's ids made one entry of ~1.4 MB at 250,000).
func TestUndoPagesAndAuditsCounts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pipelinetest.Postgres(t)
	rows := make([]pipelinetest.PoisonRow, 1200)
	for i := range rows {
		rows[i] = pipelinetest.PoisonRow{Handler: "undo.pages", Reason: "r"}
	}
	ids := pipelinetest.InsertPoison(t, pool, rows...)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	_, err = store.DiscardEach(ctx, pgpoison.Selector{IDs: ids}, pgpoison.Run{Actor: "test", ID: "run-big"}, func(pgpoison.Action) error { return nil })
	require.NoError(t, err)
	require.Zero(t, pipelinetest.CountPoisoned(t, pool, pgpoison.Filter{Handler: "undo.pages"}))

	var pages []int
	n, err := store.UndoEach(ctx, "run-big", "ops@test", func(back []int64) error {
		pages = append(pages, len(back))
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 1200, n)
	require.Equal(t, []int{500, 500, 200}, pages)
	require.Equal(t, ids, pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{Handler: "undo.pages"}), "back under their ids")
	entries := pipelinetest.Audited(t, pool, "poison.undo")
	require.Len(t, entries, 3)
	for _, e := range entries {
		require.Equal(t, "run-big", e.Detail["run"])
		require.NotContains(t, e.Detail, "ids")
	}
	_, err = store.UndoEach(ctx, "run-big", "ops@test", func([]int64) error { return nil })
	require.ErrorIs(t, err, pgpoison.ErrNothingToUndo)
}
