package pgoutbox

// The statements' catalogue, family "record": what a batch writes of its
// outcome. The append-only lane writes none of these for a row sent at its
// first try (its position passes it); the slow and id lanes mark each row.

// markDispatchedSQL marks the rows $1 dispatched, an attempt spent.
func (t Table) markDispatchedSQL() string {
	return `UPDATE ` + t.Quoted() + ` SET dispatched_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`
}

// markShadowedSQL marks the shadow intents $1 dispatched, never published.
func (t Table) markShadowedSQL() string {
	return `UPDATE ` + t.Quoted() + ` SET dispatched_at = now(), shadowed = true WHERE id = ANY($1)`
}

// markFailedSQL records failed publishes ($1 ids, $2 errors, $3 backoff
// delays in microseconds): a failed row keeps its state itself from now
// on, in the slow lane.
func (t Table) markFailedSQL() string {
	return `UPDATE ` + t.Quoted() + ` AS o
			SET attempts = o.attempts + 1, last_error = f.err, slow = true,
			    available_at = now() + f.delay_us * interval '1 microsecond'
			FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, err, delay_us)
			WHERE o.id = f.id`
}

// markSlowSQL moves the rows $1 to the slow lane (the append-only lane's
// rows that are delayed, held or left unsent).
func (t Table) markSlowSQL() string {
	return `UPDATE ` + t.Quoted() + ` SET slow = true WHERE id = ANY($1)`
}

// nextDueSQL reads when the slow lane's next row is due.
func (t Table) nextDueSQL() string {
	return `SELECT min(available_at) FROM ` + t.Quoted() + ` o WHERE ` + slowCond("o")
}
