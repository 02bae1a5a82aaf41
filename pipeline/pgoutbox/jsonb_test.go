package pgoutbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// jsonish makes JSON-like payloads around what PostgreSQL's jsonb
// refuses and Go's json.Valid does not: escapes of every kind (NUL, lone
// and paired surrogates), invalid UTF-8, numbers at numeric's bounds, and
// byte-level damage to valid documents.
type jsonish struct{ r *rand.Rand }

func (g jsonish) hex4() string {
	switch g.r.IntN(6) {
	case 0:
		return fmt.Sprintf("%04x", 0xD800+g.r.IntN(0x400)) // high surrogate
	case 1:
		return fmt.Sprintf("%04X", 0xDC00+g.r.IntN(0x400)) // low surrogate
	case 2:
		return "0000"
	default:
		return fmt.Sprintf("%04x", g.r.IntN(0x10000))
	}
}

func (g jsonish) str() string {
	var b strings.Builder
	b.WriteByte('"')
	for range g.r.IntN(6) {
		switch g.r.IntN(8) {
		case 0:
			b.WriteString(`\u` + g.hex4())
		case 1:
			b.WriteString(`\ud83d\ude00`)
		case 2:
			b.WriteString(`\ud800\u0041`)
		case 3:
			b.WriteString([]string{`\n`, `\"`, `\\`, `\/`, `\t`}[g.r.IntN(5)])
		case 4:
			b.WriteString([]string{"é", "日本", "\xff", "\xc3", "\xed\xa0\x80", "\x00", "\x01"}[g.r.IntN(7)])
		default:
			b.WriteString("ab")
		}
	}
	b.WriteByte('"')
	return b.String()
}

func (g jsonish) digits(n int) string {
	if n <= 0 {
		return ""
	}
	var b strings.Builder
	for range n {
		b.WriteByte(byte('0' + g.r.IntN(10)))
	}
	return b.String()
}

// number is a JSON number near numeric's bounds: the weight of its leading
// digit around 131071, its scale around 16383, its exponent around 2^30.
func (g jsonish) number() string {
	var b strings.Builder
	if g.r.IntN(3) == 0 {
		b.WriteByte('-')
	}
	zero := g.r.IntN(5) == 0
	intPart := "0"
	if !zero && g.r.IntN(2) == 0 {
		intPart = strconv.Itoa(1+g.r.IntN(9)) + g.digits(g.r.IntN(4))
	}
	b.WriteString(intPart)
	frac := ""
	if g.r.IntN(2) == 0 {
		frac = g.digits(1 + g.r.IntN(5))
		if zero {
			frac = strings.Repeat("0", len(frac))
		} else if intPart == "0" {
			frac = strings.Repeat("0", g.r.IntN(3)) + "1" + frac
		}
		b.WriteString("." + frac)
	} else if intPart == "0" && !zero {
		b.Reset()
		b.WriteString(strconv.Itoa(1 + g.r.IntN(9)))
	}
	var exp int
	switch g.r.IntN(6) {
	case 0:
		exp = 131071 - 8 + g.r.IntN(16)
	case 1:
		exp = -16383 - 8 + g.r.IntN(16)
	case 2:
		exp = 1<<30 - 2 + g.r.IntN(4)
		if g.r.IntN(2) == 0 {
			exp = -exp
		}
	case 3:
		exp = g.r.IntN(2000) - 1000
	default:
		return b.String()
	}
	return b.String() + []string{"e", "E", "e+"}[g.r.IntN(3)] + strconv.Itoa(exp)
}

func (g jsonish) value(depth int) string {
	switch n := g.r.IntN(7); {
	case n == 0 && depth < 3:
		parts := make([]string, g.r.IntN(4))
		for i := range parts {
			parts[i] = g.value(depth + 1)
		}
		return "[" + strings.Join(parts, ",") + "]"
	case n == 1 && depth < 3:
		parts := make([]string, g.r.IntN(4))
		for i := range parts {
			parts[i] = g.str() + ":" + g.value(depth+1)
		}
		return "{" + strings.Join(parts, ",") + "}"
	case n == 2 || n == 3:
		return g.str()
	case n == 4:
		return []string{"true", "false", "null"}[g.r.IntN(3)]
	default:
		return g.number()
	}
}

func (g jsonish) payload() []byte {
	b := []byte(g.value(0))
	if g.r.IntN(8) == 0 && len(b) > 0 { // damage
		b[g.r.IntN(len(b))] = byte(g.r.IntN(256))
	}
	return b
}

// jsonb's own verdict, from the server: the payload as text cast to jsonb.
func postgresTakes(ctx context.Context, pool *pgxpool.Pool, b []byte) bool {
	_, err := pool.Exec(ctx, `SELECT $1::text::jsonb`, string(b))
	return err == nil
}

// Whether PostgreSQL's jsonb takes a payload is decided exactly as the
// server decides, before the write: on thousands of random JSON-ish
// payloads the outbox's verdict equals the server's own, and publishing
// each of them in a transaction of the caller's, beside a business write,
// never fails: jsonb where the server takes it, bytes with payload NULL
// where it does not. The same holds for a durable retry of such a
// payload (written by Ferry after a handler failed on it).
func TestJSONBCanHoldAgreesWithPostgreSQL(t *testing.T) {
	t.Parallel()
	pool := thingsDB(t)
	ctx := context.Background()
	g := jsonish{rand.New(rand.NewPCG(7, 11))}
	fixed := [][]byte{
		[]byte(`{"a":"\ud800"}`), []byte(`{"a":"\udc00"}`), []byte(`{"a":"\ud800\udc00"}`), []byte(`{"a":"\u0000"}`),
		[]byte(`1e1000000`), []byte(`1e131071`), []byte(`1e131072`), []byte(`15e131071`), []byte(`1e-16383`), []byte(`0.1e-16383`),
		[]byte(`0e1000000`), []byte(`0.0e-99999`), []byte(`-0e99999999`), []byte(`0e2000000000`),
		[]byte("1" + strings.Repeat("0", 140_000)), []byte("{\"a\":\"\xff\"}"), []byte("{\"a\":\"\xed\xa0\x80\"}"),
		[]byte(`[[[[1]]]]`), []byte(``), []byte(`{"a":1} x`),
	}
	type verdict struct {
		payload []byte
		pg      bool
	}
	var cases []verdict
	disagree := 0
	check := func(b []byte) {
		pg := postgresTakes(ctx, pool, b)
		if ours := pgoutbox.JSONBCanHold(b); ours != pg {
			disagree++
			if disagree <= 10 {
				t.Errorf("%.120q: the outbox says jsonb takes it: %v, PostgreSQL: %v", b, ours, pg)
			}
		}
		cases = append(cases, verdict{b, pg})
	}
	for _, b := range fixed {
		check(b)
	}
	const n = 3000
	for range n {
		check(g.payload())
	}
	refused := 0
	for _, c := range cases {
		if !c.pg {
			refused++
		}
	}
	t.Logf("%d payloads, %d refused by jsonb, %d verdicts differ", len(cases), refused, disagree)
	require.Greater(t, refused, n/10, "the generator must reach what jsonb refuses")
	require.Greater(t, len(cases)-refused, n/10, "and what it takes")

	// Published beside a business write: never an error.
	ob := pipelinetest.Outbox(t)
	for i, c := range cases {
		if i%5 != 0 {
			continue
		}
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		msg := message.NewMessage(fmt.Sprintf("jsonish-%d", i), c.payload)
		require.NoError(t, ob.PublishTx(ctx, pgoutbox.PgxTx(tx), "thing.made", msg), "%.120q", c.payload)
		_, err = tx.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, fmt.Sprintf("jsonish-%d", i))
		require.NoError(t, err, "the caller's transaction survives %.120q", c.payload)
		require.NoError(t, tx.Commit(ctx))
		row := rowWhere(t, pool, "message_uuid = $1", msg.UUID)
		stored, raw := row.Payload != "", row.Raw
		require.Equal(t, c.pg, stored, "%.120q: jsonb exactly when PostgreSQL takes it", c.payload)
		require.Equal(t, c.payload, raw, "the bytes are kept as they came")
	}

	// A durable retry of a payload jsonb refuses is written, not taken for
	// a database outage (which would hold the delivery for ever).
	rs, err := pgoutbox.NewRescheduler(pool, ob)
	require.NoError(t, err)
	for i, c := range cases[:len(fixed)] {
		err := rs.ScheduleRetry(ctx, pipeline.Retry{AggregateID: "a", Payload: c.payload, Delay: time.Minute, Headers: map[string]string{
			pipeline.MetaMessageID: fmt.Sprintf("retry-%d", i), pipeline.MetaRetryQueue: "thing.handler",
		}})
		require.NoError(t, err, "%.120q", c.payload)
	}
}

// On a server at the lowest max_stack_depth PostgreSQL allows (100 kB),
// publishing a deeply nested payload beside a business write never aborts
// the caller's transaction: what jsonb can hold at any setting is stored as
// jsonb, deeper is kept as bytes. At the earlier bound (1,000) a payload
// 1,000 deep aborted it.
func TestDeepPayloadsNeverAbortTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool := thingsDB(t)
	ctx := context.Background()
	ob := pipelinetest.Outbox(t)
	nested := func(depth int) []byte {
		return []byte(strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth))
	}
	for _, depth := range []int{100, 256, 257, 630, 1000} {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) }) // a failed step must not leave the schema locked
		_, err = tx.Exec(ctx, `SET LOCAL max_stack_depth = '100kB'`)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `INSERT INTO things (name) VALUES ($1)`, fmt.Sprintf("deep-%d", depth))
		require.NoError(t, err)
		msg := message.NewMessage(fmt.Sprintf("deep-%d", depth), nested(depth))
		msg.Metadata.Set(pipeline.MetaAggregateID, "deep")
		require.NoError(t, ob.PublishTx(ctx, pgoutbox.PgxTx(tx), "deep.t", msg), "depth %d", depth)
		require.NoError(t, tx.Commit(ctx), "depth %d: the caller's transaction commits", depth)
		row := rowWhere(t, pool, "message_uuid = $1", msg.UUID)
		require.Equal(t, pgoutbox.JSONBCanHold(nested(depth)), row.Payload != "", "depth %d", depth)
		if row.Payload == "" {
			require.Equal(t, nested(depth), row.Raw, "depth %d: kept as bytes", depth)
		}
	}
	require.True(t, pgoutbox.JSONBCanHold(nested(256)))
	require.False(t, pgoutbox.JSONBCanHold(nested(257)))
}
