package pipeline

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// ErrReservedMetadata is returned (wrapped with ErrInvalidEvent) when a
// producer sets metadata that only Ferry may set: see ReservedMetadata.
var ErrReservedMetadata = errors.New("metadata key is reserved for Ferry")

// MetaBackfill names the backfill that wrote an intent (backfill sets it).
// A label for operators: no consumer decides anything by it, so it is not
// reserved.
const MetaBackfill = "ferry_backfill"

// producerKeys are the ferry_ keys a producer may set: instructions to the
// outbox, which consumes them (they never reach a consumer), and labels.
var producerKeys = []string{MetaDelay, MetaDeliverAt, MetaTopic, MetaBackfill}

// bookkeepingKeys are the keys without the ferry_ prefix that Ferry, Watermill
// or RabbitMQ set on a message in flight, and that consumers trust.
var bookkeepingKeys = []string{
	MetaOutboxCreatedAt, MetaOutboxAttempt,
	MetaPoisonedAt, MetaPoisonPermanent, MetaPoisonedConsumer,
	wmiddleware.ReasonForPoisonedKey, wmiddleware.PoisonedTopicKey,
	wmiddleware.PoisonedHandlerKey, wmiddleware.PoisonedSubscriberKey,
	"x-delivery-count", "x-death",
}

// ReservedMetadata reports whether key is Ferry's own: a message's identity
// (MetaMessageID), its place in the outbox (MetaOutboxID, MetaOutboxAttempt,
// MetaOutboxCreatedAt), its attempts and failure history (MetaAttempt,
// MetaErrorHistory, MetaLastError, ...), where a retry goes (MetaRetryQueue,
// MetaOriginalTopic), the poison store's and Watermill's poison keys, the
// broker's delivery bookkeeping (x-delivery-count, x-death, x-first-death-*,
// x-last-death-*) and Watermill's transport keys (_watermill_*).
//
// Every key with the prefix "ferry_" is reserved except the instructions a
// producer gives the outbox (MetaDelay, MetaDeliverAt, MetaTopic) and the
// MetaBackfill label. The outbox refuses a message that sets a reserved key
// (an error wrapping ErrReservedMetadata and ErrInvalidEvent) on every
// publish path, before anything is written: consumers trust these keys, so
// a producer could otherwise change a message's identity or history.
func ReservedMetadata(key string) bool {
	switch {
	case strings.HasPrefix(key, "ferry_"):
		return !slices.Contains(producerKeys, key)
	case strings.HasPrefix(key, "_watermill"),
		strings.HasPrefix(key, "x-first-death-"), strings.HasPrefix(key, "x-last-death-"):
		return true
	}
	return slices.Contains(bookkeepingKeys, key)
}

// observabilityKeys say how a message was caused and traced, not what it
// says: the same message can travel under another trace (a replay, a
// requeue by an operator), and RabbitMQ's correlation-id property fills
// MetaCorrelationID in when a header lacks it.
var observabilityKeys = []string{MetaCorrelationID, MetaTraceParent, "tracestate", MetaTraceID}

// ContentMetadata reports whether key is part of a message's content, which
// a ledger compares when a processed message id comes again (see
// ContentDigest): every key but the reserved ones, the other ferry_ keys,
// and the correlation and trace keys. A handler that decides by metadata
// (tenant_id, schema_version, its own keys) decides by content.
func ContentMetadata(key string) bool {
	return !strings.HasPrefix(key, "ferry_") && !ReservedMetadata(key) && !slices.Contains(observabilityKeys, key)
}

// DigestSize is the length of a ContentDigest.
const DigestSize = 2 * sha256.Size

// ContentDigest identifies msg's content for a ledger: a message id that
// comes again with another digest is not a redelivery but another message
// under a reused id (ErrIDConflict). Its first half is the SHA-256 of the
// payload and of the ContentMetadata with a non-empty value (sorted, each
// length-prefixed, so no two contents encode alike); its second half is
// the SHA-256 of the payload alone, which is what ledgers stored before
// metadata counted (see SameContent).
func ContentDigest(msg *message.Message) []byte {
	keys := make([]string, 0, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if v != "" && ContentMetadata(k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	h := sha256.New()
	field := func(b []byte) {
		_ = binary.Write(h, binary.BigEndian, uint64(len(b)))
		h.Write(b)
	}
	field([]byte("ferry content v2"))
	field(msg.Payload)
	for _, k := range keys {
		field([]byte(k))
		field([]byte(msg.Metadata[k]))
	}
	payload := sha256.Sum256(msg.Payload)
	return append(h.Sum(make([]byte, 0, DigestSize)), payload[:]...)
}

// SameContent reports whether a digest a ledger stored and a ContentDigest
// describe the same content. A stored digest of sha256.Size bytes was
// written before metadata counted: it is compared with the payload half.
func SameContent(stored, digest []byte) bool {
	switch {
	case stored == nil || digest == nil:
		return true // nothing to compare
	case len(stored) == sha256.Size && len(digest) == DigestSize:
		return string(stored) == string(digest[sha256.Size:])
	}
	return string(stored) == string(digest)
}

// CleanText makes s storable and printable wherever Ferry keeps text (the
// poison store's reasons and headers, error histories, last_error, logs):
// invalid UTF-8 becomes U+FFFD, NUL (which PostgreSQL's text and jsonb
// refuse) becomes U+FFFD too, and the result is cut to at most max bytes on
// a rune boundary (max <= 0: no cut). A provider's error in Latin-1 or a
// header holding a NUL must never make a message unstorable.
func CleanText(s string, max int) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	}
	if max > 0 && len(s) > max {
		n := max
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	return s
}

// ValidText reports whether s can be stored as it is: valid UTF-8 without NUL.
func ValidText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// RedactURL hides the credentials of a connection setting for messages
// and logs, in every form pgx and amqp091 read them from: the user
// information's password, a query parameter (pgx's password and
// sslpassword, or any parameter whose name says password, secret or token),
// and a keyword/value string's password= and sslpassword= (quoted or not).
// A URL that does not parse as its writer meant (a password with an
// unescaped "/", "?" or "#" moves the password into the host or path) is
// masked from the scheme to its last "@", so no reading of it shows the
// password.
func RedactURL(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		if strings.Contains(raw, "=") {
			return CleanText(secretKeyword.ReplaceAllString(raw, "${1}=xxxxx"), 400)
		}
		if strings.Contains(raw, "@") {
			return "<connection string>"
		}
		return CleanText(raw, 200)
	}
	u, err := url.Parse(raw)
	if err == nil && ValidateConnectionURL(raw) == nil {
		if u.RawQuery != "" {
			if _, qerr := url.ParseQuery(u.RawQuery); qerr != nil {
				// A query it cannot read whole (a password with "%" or
				// ";"): u.Query drops the pairs it cannot read and the raw
				// query kept them, password and all.
				u.RawQuery = ""
				return u.Redacted() + "?<hidden>"
			}
		}
		if q := u.Query(); len(q) > 0 {
			changed := false
			for k := range q {
				if secretParam(k) {
					q[k] = []string{"xxxxx"}
					changed = true
				}
			}
			if changed {
				u.RawQuery = q.Encode()
			}
		}
		return u.Redacted()
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		if strings.Contains(rest, "?") {
			// No user information, but a query it cannot read: the
			// password may be in it.
			return scheme + "://" + CleanText(rest[:strings.Index(rest, "?")], 200) + "?<unparseable query>"
		}
		return scheme + "://<unparseable URL>"
	}
	host := rest[at+1:]
	if i := strings.Index(host, "?"); i >= 0 {
		host = host[:i] + "?<query hidden>"
	}
	return scheme + "://xxxxx@" + CleanText(host, 200)
}

// secretKeyword matches a password in a keyword/value connection string
// (pgx, libpq): password=s3cret, password = 's3 cret', sslpassword=...
var secretKeyword = regexp.MustCompile(`(?i)\b((?:ssl)?password|[a-z_]*(?:secret|token)[a-z_]*)\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S+)`)

// secretParam reports whether a URL query parameter carries a credential.
func secretParam(name string) bool {
	n := strings.ToLower(name)
	return strings.Contains(n, "password") || strings.Contains(n, "secret") || strings.Contains(n, "token")
}

// ValidateConnectionURL refuses a URL whose credentials would be misread:
// one that does not parse, or whose "@" is not the one that ends the user
// information (a password holding an unescaped "/", "?", "#" or "@", which
// a driver then reads as the host, the path or the database, and prints).
// Percent-encode such characters (%2F, %3F, %23, %40).
func ValidateConnectionURL(raw string) error {
	_, rest, _ := strings.Cut(raw, "://")
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return errors.New("the URL does not parse (percent-encode special characters in the user and password)")
	case strings.Count(rest, "@") > 1, strings.Contains(rest, "@") && u.User == nil,
		u.User != nil && strings.ContainsAny(u.User.String(), "/?#"):
		return errors.New(`the user or password holds a character that must be percent-encoded ("/" as %2F, "?" as %3F, "#" as %23, "@" as %40)`)
	}
	return nil
}
