package pgoutbox

import (
	"strconv"
	"time"

	"github.com/ferry-dev/ferry/pipeline"
)

// The statements' catalogue, family "claim": the slow lane's claims, the
// id lane's lock and the idle relay's probe (see lanes.go).

// ClaimSQL is the slow lane's claim query for t, for EXPLAIN and
// benchmarks: its named arguments (pgx.NamedArgs) are @limit, the batch
// size, and, when ordered, @topics, the ordered topics.
func (t Table) ClaimSQL(ordered bool) string { return t.claimSQL(ordered, 0) }

// claimSQL selects the slow lane's due, unclaimed rows (see lanes.go).
// ORDER BY available_at follows the partial index on them, so the claim
// stays an index range scan at any table size. With ordered topics, a row
// of one is due only if every earlier pending row of its aggregate is a
// due row of the slow lane too: an aggregate's run of rows, from its head,
// goes in one batch (in waves, publishInOrder), so that a busy aggregate
// held behind a failure drains at a batch's size per batch, not one row.
// Each row comes with prev, the id of the aggregate's previous pending
// row (NULL at the head): runsFromHeads keeps a row only when prev was
// claimed by this batch too, so a run whose head another relay holds, or
// which LIMIT cut, stops there, and two relays never hold rows of one
// ordered aggregate at once. When it leaves rows out, headsSQL claims
// the runs of their aggregates from their heads (see slowBatch).
//
// minAge > 0 leaves younger rows alone: the CDC relay's safety net polls
// with it, so that it takes what the stream left, not what the stream is
// about to send.
func (t Table) claimSQL(ordered bool, minAge time.Duration) string {
	return t.claimColumns(ordered) + `
		WHERE ` + t.dueSQL(ordered, minAge, true) + `
		ORDER BY o.available_at
		LIMIT @limit
		FOR UPDATE OF o SKIP LOCKED`
}

// headsSQL claims, as claimSQL, the due rows of ordered topics of the
// aggregates @aggregates, in id order: each aggregate's run from its head. Rows
// held behind a failing head keep the due time they were written with,
// earlier than the head's backoff, so claimSQL's page, in due time order,
// can hold only rows behind heads it did not reach: with more such rows
// than a batch, every claim took the same page and published none of it,
// and the ordered topics stalled for good (after a broker outage, or a
// failover replay that makes every row due at once). Every row of that
// page is due, so each of its aggregates' earlier rows is due too: its
// head is due, unless another relay holds it. Index probes of the slow
// lane's (aggregate_id, id) index, per aggregate: a scan of the whole lane
// for its heads took seconds per claim with 50,000 rows waiting.
func (t Table) headsSQL(minAge time.Duration) string {
	return t.claimColumns(true) + `
		WHERE o.aggregate_id = ANY(@aggregates::text[]) AND o.topic = ANY(@topics::text[])
		  AND ` + t.dueSQL(true, minAge, true) + `
		ORDER BY o.aggregate_id, o.id
		LIMIT @limit
		FOR UPDATE OF o SKIP LOCKED`
}

// claimColumns is the SELECT of the slow lane's claims, with prev.
func (t Table) claimColumns(ordered bool) string {
	table := t.Quoted()
	prev := `NULL::bigint`
	if ordered {
		// Every earlier pending row is a slow one (the claims' condition):
		// the previous is the nearest by the slow lane's (aggregate_id,
		// id) index.
		prev = `CASE WHEN o.topic = ANY(@topics::text[]) THEN (SELECT max(p.id) FROM ` + table + ` p
		        WHERE p.aggregate_id = o.aggregate_id AND ` + slowCond("p") + `
		          AND p.id < o.id AND p.topic = ANY(@topics::text[])) END`
	}
	return `SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
		       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')), o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at),
		       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false), ` + prev + `
		FROM ` + table + ` o`
}

// probeSQL asks whether a batch would find a row, without claiming
// (when ordered, @topics the ordered topics): a due row of the slow
// lane, or a row the position has not passed. Index probes, no
// transaction, no lock.
func (t Table) probeSQL(ordered bool, minAge time.Duration) string {
	table := t.Quoted()
	young := ""
	if minAge > 0 {
		young = ` AND o.created_at <= now() - ` + strconv.FormatInt(minAge.Microseconds(), 10) + ` * interval '1 microsecond'`
	}
	return `SELECT EXISTS (SELECT 1 FROM ` + table + ` o WHERE ` + t.dueSQL(ordered, minAge, false) + `)
		OR EXISTS (` + t.unpassedRows("1", table) + young + `)`
}

// dueSQL is the condition on outbox row o that makes it the slow lane's
// claim: slow and pending, due, old enough, and, when ordered (@topics
// the ordered topics), the head of its aggregate or, with
// runs, behind due rows of the slow lane only (see claimSQL).
func (t Table) dueSQL(ordered bool, minAge time.Duration, runs bool) string {
	q := slowCond("o") + ` AND o.available_at <= now()`
	if minAge > 0 {
		q += ` AND o.created_at <= now() - ` + strconv.FormatInt(minAge.Microseconds(), 10) + ` * interval '1 microsecond'`
	}
	if ordered {
		before := t.earlierPending("o", "")
		if runs {
			before = t.earlierPending("o", "", `p.available_at > now()`)
		}
		q += `
		  AND (o.topic <> ALL(@topics::text[]) OR NOT ` + before + `)`
	}
	return q
}

// earlierPending is true when an earlier row of o's aggregate, of an
// ordered topic (@topics), is pending: with state of its own (the slow
// lane's partial index), or not passed by the position yet (the
// aggregate's rows since the position's oldest transaction, by the
// (aggregate_id, tx) index). except, if set, is a condition on p that
// leaves rows out; slowOnly, if given, one the slow rows must meet too to
// count.
func (t Table) earlierPending(o, except string, slowOnly ...string) string {
	table := t.Quoted()
	if except != "" {
		except = ` AND NOT (` + except + `)`
	}
	slowExtra := ""
	for _, c := range slowOnly {
		slowExtra += ` AND ` + c
	}
	pos := t.positionSnap()
	return `(EXISTS (SELECT 1 FROM ` + table + ` p
		        WHERE p.aggregate_id = ` + o + `.aggregate_id AND ` + slowCond("p") + slowExtra + `
		          AND p.id < ` + o + `.id AND p.topic = ANY(@topics::text[])` + except + `)
		    OR EXISTS (SELECT 1 FROM ` + table + ` p
		        WHERE p.aggregate_id = ` + o + `.aggregate_id AND p.tx >= pg_snapshot_xmin(` + pos + `)
		          AND p.dispatched_at IS NULL AND NOT p.slow
		          AND p.id < ` + o + `.id AND p.topic = ANY(@topics::text[])` + except + `
		          AND NOT ` + t.passedCond("p") + `))`
}

// lockSQL is RelayIDs' query (@ids the ids, @topics the ordered topics
// when ordered): every row of @ids with its topic and aggregate, and, for each row
// it could lock, what RelayIDs needs to decide. Another relay's locked rows
// come back with locked false (read without waiting, at their committed
// version: topic and aggregate never change), so RelayIDs knows which
// aggregate they hold back. A row is done when marked dispatched or passed
// by the position.
func (t Table) lockSQL(ordered bool) string {
	table := t.Quoted()
	behind := `false`
	if ordered {
		behind = `(l.topic = ANY(@topics::text[]) AND ` + t.earlierPending("l", "p.id = ANY(@ids::bigint[])") + `)`
	}
	return `WITH l AS (
		SELECT o.id, o.message_uuid, o.aggregate_id, o.topic,
		       COALESCE(o.payload_raw, convert_to(o.payload::text, 'UTF8')) AS payload, o.headers, o.attempts, o.created_at, COALESCE(o.due_at, o.created_at) AS due_at,
		       COALESCE(o.headers->>'` + pipeline.MetaShadow + `' = 'true', false) AS shadow,
		       ` + t.dispatchedCond("o") + ` AS done, o.available_at <= now() AS due
		FROM ` + table + ` o
		WHERE o.id = ANY(@ids::bigint[])
		FOR UPDATE OF o SKIP LOCKED)
	SELECT a.id, a.topic, a.aggregate_id, l.id IS NOT NULL,
	       l.message_uuid, l.payload, l.headers, l.attempts, l.created_at, l.due_at, l.shadow, l.done, l.due,
	       CASE WHEN l.id IS NULL THEN NULL ELSE ` + behind + ` END
	FROM ` + table + ` a LEFT JOIN l ON l.id = a.id
	WHERE a.id = ANY(@ids::bigint[])
	ORDER BY a.id`
}
