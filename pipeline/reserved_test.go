package pipeline_test

import (
	"crypto/sha256"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

func TestReservedMetadata(t *testing.T) {
	t.Parallel()
	for _, k := range []string{
		pipeline.MetaMessageID, pipeline.MetaOutboxID, pipeline.MetaAttempt, pipeline.MetaErrorHistory,
		pipeline.MetaLastError, pipeline.MetaRetryQueue, pipeline.MetaOriginalTopic, "ferry_future_key",
		pipeline.MetaOutboxAttempt, pipeline.MetaOutboxCreatedAt, pipeline.MetaPoisonedAt, pipeline.MetaPoisonPermanent,
		pipeline.MetaPoisonedConsumer, "reason_poisoned", "handler_poisoned", "_watermill_message_uuid",
		"x-delivery-count", "x-death", "x-first-death-queue",
	} {
		require.True(t, pipeline.ReservedMetadata(k), k)
		require.False(t, pipeline.ContentMetadata(k), k)
	}
	for _, k := range []string{
		pipeline.MetaDelay, pipeline.MetaDeliverAt, pipeline.MetaTopic, pipeline.MetaBackfill,
		pipeline.MetaTenantID, pipeline.MetaSchemaVersion, pipeline.MetaCorrelationID, pipeline.MetaTraceParent,
		pipeline.MetaShadow, "x-request-id", "my_key",
	} {
		require.False(t, pipeline.ReservedMetadata(k), k)
	}
}

// The content a ledger compares: the payload and what a handler decides
// by (tenant, schema version, the aggregate, its own keys), not how the
// message was traced or delivered.
func TestContentDigest(t *testing.T) {
	t.Parallel()
	msg := func(md map[string]string) *message.Message {
		m := message.NewMessage("id-1", []byte(`{"amount":100}`))
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		return m
	}
	base := pipeline.ContentDigest(msg(map[string]string{"tenant_id": "acme", "schema_version": "1", "aggregate_id": "o-1"}))
	require.Len(t, base, pipeline.DigestSize)

	same := pipeline.ContentDigest(msg(map[string]string{
		"tenant_id": "acme", "schema_version": "1", "aggregate_id": "o-1",
		// delivered again, retried, traced otherwise, requeued:
		"x-delivery-count": "3", "ferry_attempt": "2", "ferry_message_id": "id-1", "ferry_error_history": "[]",
		"outbox_attempt": "2", "outbox_created_at": "2026-12-03T00:00:00Z", "correlation_id": "other",
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "trace_id": "0af7651916cd43dd8448eb211c80319c",
		"ferry_requeued_from_poison_id": "7", "empty": "",
	}))
	require.True(t, pipeline.SameContent(base, same))

	for name, md := range map[string]map[string]string{
		"another tenant":         {"tenant_id": "evil", "schema_version": "1", "aggregate_id": "o-1"},
		"another schema version": {"tenant_id": "acme", "schema_version": "2", "aggregate_id": "o-1"},
		"another aggregate":      {"tenant_id": "acme", "schema_version": "1", "aggregate_id": "o-2"},
		"a key more":             {"tenant_id": "acme", "schema_version": "1", "aggregate_id": "o-1", "currency": "EUR"},
		"a key less":             {"tenant_id": "acme", "schema_version": "1"},
		// Keys and values run together must not collide.
		"shifted boundary": {"tenant_id": "acmeschema_version1", "aggregate_id": "o-1"},
	} {
		require.False(t, pipeline.SameContent(base, pipeline.ContentDigest(msg(md))), name)
	}
	other := message.NewMessage("id-1", []byte(`{"amount":999}`))
	other.Metadata = msg(map[string]string{"tenant_id": "acme", "schema_version": "1", "aggregate_id": "o-1"}).Metadata
	require.False(t, pipeline.SameContent(base, pipeline.ContentDigest(other)), "another payload")

	// A ledger row written before metadata counted holds the payload's
	// SHA-256: the same payload is the same message, another is not.
	legacy := sha256.Sum256([]byte(`{"amount":100}`))
	require.True(t, pipeline.SameContent(legacy[:], base))
	require.False(t, pipeline.SameContent(legacy[:], pipeline.ContentDigest(other)))
	require.True(t, pipeline.SameContent(nil, base), "nothing stored: nothing to compare")
}

func TestCleanText(t *testing.T) {
	t.Parallel()
	require.Equal(t, "Kunde ung\uFFFDltig", pipeline.CleanText("Kunde ung\xfcltig", 0))
	require.Equal(t, "a\uFFFDb", pipeline.CleanText("a\x00b", 0))
	require.Equal(t, "plain", pipeline.CleanText("plain", 0))
	long := strings.Repeat("ü", 100) // two bytes each
	cut := pipeline.CleanText(long, 51)
	require.True(t, utf8.ValidString(cut))
	require.Len(t, cut, 50, "cut on a rune boundary, at most max bytes")
	for _, s := range []string{"\xff\x00\xfe", "ok", strings.Repeat("\x00", 10)} {
		c := pipeline.CleanText(s, 5)
		require.True(t, pipeline.ValidText(c), "%q -> %q", s, c)
		require.LessOrEqual(t, len(c), 5)
	}
}

// One rule for every topic, a route's and an event's: what a producer may
// write, some route can consume.
func TestValidateTopicName(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"orders.created", "a-b_c:d", "0", strings.Repeat("x", pipeline.MaxTopicLength)} {
		require.NoError(t, pipeline.ValidateTopicName(ok), ok)
	}
	for _, bad := range []string{"", "amq.invoices.created", "amq.", "a b", "a\x00b", "caf\xe9", "ünicode",
		"orders$v2", ".leading", "-leading", strings.Repeat("x", pipeline.MaxTopicLength+1),
		pipeline.RetryTopic, "ferry.unrouted", "ferry.anything"} {
		err := pipeline.ValidateTopicName(bad)
		require.ErrorIs(t, err, pipeline.ErrInvalidEvent, "%q", bad)
	}
}

// Identity is the publisher's UUID: no metadata replaces it.
func TestMessageIDIsTheUUID(t *testing.T) {
	t.Parallel()
	m := message.NewMessage("the-uuid", nil)
	m.Metadata.Set(pipeline.MetaMessageID, "forged")
	require.Equal(t, "the-uuid", pipeline.MessageID(m))
}

// A password never shows, even in a URL that does not parse as its writer
// meant (an unescaped "/" in the password makes url.Parse read it as the
// host and path).
func TestRedactURL(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]string{
		"postgres://u:S3cret@h:5432/db?sslmode=disable": "postgres://u:xxxxx@h:5432/db?sslmode=disable",
		"amqp://guest:guest@127.0.0.1:5672/":            "amqp://guest:xxxxx@127.0.0.1:5672/",
		"amqp://h:5672/vhost":                           "amqp://h:5672/vhost",
		// pgx reads a password from the query too.
		"postgres://u@h/db?password=S3cret&sslmode=disable":     "postgres://u@h/db?password=xxxxx&sslmode=disable",
		"postgres://h/db?user=u&password=S3cret":                "postgres://h/db?password=xxxxx&user=u",
		"postgres://u@h/db?sslpassword=S3cret&sslcert=/c.pem":   "postgres://u@h/db?sslcert=%2Fc.pem&sslpassword=xxxxx",
		"host=h user=u password=S3cret dbname=x":                "host=h user=u password=xxxxx dbname=x",
		"host=h password='S3 cret' dbname=x sslpassword=S3cret": "host=h password=xxxxx dbname=x sslpassword=xxxxx",
	} {
		require.Equal(t, want, pipeline.RedactURL(raw))
	}
	for _, raw := range []string{
		"postgres://u:12/S3cret@h/db", "amqp://u:12/S3cret@h/", "postgres://u:p%zzS3cret@h/db",
		"postgres://u:a?S3cret@h/db", "postgres://u:a#S3cret@h/db", "postgres://u:a@S3cret@h/db",
		"host=h password=S3cret dbname=x", "host=h PASSWORD = S3cret", "postgres://u:a/b@h/db?password=S3cret",
		"postgres://h/db?password=S3cret&x=%zz", "postgres://u@h/db?api_token=S3cret",
		// A password with "%" or ";" in the query: the pair cannot be read,
		// and the raw query kept it.
		"postgres://u@h/db?password=S3cret%zz&sslmode=disable", "postgres://u@h/db?password=S3cret;x&sslmode=disable",
		"postgres://u@h/db?sslmode=disable;password=S3cret",
	} {
		got := pipeline.RedactURL(raw)
		require.NotContains(t, got, "S3cret", raw)
	}
	require.Equal(t, "postgres://u@h/db?<hidden>", pipeline.RedactURL("postgres://u@h/db?password=S3cret;x&sslmode=disable"))
}
