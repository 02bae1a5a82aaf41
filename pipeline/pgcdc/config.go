package pgcdc

import (
	"errors"
	"fmt"
	"regexp"
	"time"
)

// Defaults and bounds of Config.
const (
	DefaultBatchSize         = 500
	MaxBatchSize             = 10_000
	DefaultStatusInterval    = 10 * time.Second
	DefaultHeartbeatInterval = 10 * time.Second
	DefaultStandbyRetry      = time.Second
	// DefaultInFlight is how many RelayIDs calls the streamer makes at once:
	// 4 halved the end-to-end latency against 1 in four alternating runs on
	// a 2-core box (docs/cdc.md, "CDC relay, measured").
	DefaultInFlight = 4
	MaxInFlight     = 16
	// DefaultSafetyNetInterval and DefaultSafetyNetMinAge are the polling
	// relay's settings in CDC mode (RelayConfig.PollInterval and MinAge).
	DefaultSafetyNetInterval = 5 * time.Second
	DefaultSafetyNetMinAge   = 10 * time.Second
	// MinServerVersion is PostgreSQL 14: pgoutput's protocol version 2,
	// which streams large transactions while they are in progress.
	MinServerVersion = 140000
)

// holdBackoff is how long the streamer waits before trying a batch again
// that the broker confirmed none of (or the database refused): from
// holdBackoffMin doubling to holdBackoffMax.
const (
	holdBackoffMin = 100 * time.Millisecond
	holdBackoffMax = 5 * time.Second
)

// Config configures a Streamer.
type Config struct {
	// Slot is the logical replication slot's name: lower-case letters,
	// digits and underscores, at most 63. Slots belong to the whole
	// PostgreSQL cluster. Default "ferry_" + database + "_" + schema,
	// reduced to those characters.
	Slot string
	// Publication is the publication on the outbox table (inserts only),
	// same alphabet. Default: the slot's name.
	Publication string
	// BatchSize is how many outbox rows one RelayIDs call takes: several
	// small transactions go together, a large one in several calls.
	// Default 500, at most 10000.
	BatchSize int
	// StatusInterval is how often the streamer reports its confirmed
	// position to the server even when it has not moved (the server drops
	// a silent client after wal_sender_timeout). Default 10s.
	StatusInterval time.Duration
	// HeartbeatInterval is how long the stream may be idle before the
	// streamer writes a logical decoding message to get a position it may
	// confirm, so the slot moves past unrelated WAL. Default 10s.
	HeartbeatInterval time.Duration
	// InFlight is how many RelayIDs calls run at once: while one waits for
	// the broker's confirms the next is locked and published. Calls in
	// flight together never share an aggregate of an ordered topic, and
	// the confirmed position still moves in commit order. Default 4, at
	// most 16.
	InFlight int
	// StandbyRetry is how often a standby (another process streams the
	// slot) tries to take over. Default 1s.
	StandbyRetry time.Duration
}

var nameRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// WithDefaults returns a copy of c with zero fields set to their defaults
// (Slot and Publication are derived at start, from the connection).
func (c Config) WithDefaults() Config {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = DefaultStatusInterval
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.StandbyRetry == 0 {
		c.StandbyRetry = DefaultStandbyRetry
	}
	if c.InFlight == 0 {
		c.InFlight = DefaultInFlight
	}
	return c
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	if c.Slot != "" && !nameRE.MatchString(c.Slot) {
		errs = append(errs, fmt.Errorf("Config.Slot %q: want 1 to 63 of a-z, 0-9 and _", c.Slot))
	}
	if c.Publication != "" && !nameRE.MatchString(c.Publication) {
		errs = append(errs, fmt.Errorf("Config.Publication %q: want 1 to 63 of a-z, 0-9 and _", c.Publication))
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		errs = append(errs, fmt.Errorf("Config.BatchSize must be in [1, %d], got %d", MaxBatchSize, c.BatchSize))
	}
	if c.StatusInterval <= 0 {
		errs = append(errs, fmt.Errorf("Config.StatusInterval must be positive, got %s", c.StatusInterval))
	}
	if c.HeartbeatInterval <= 0 {
		errs = append(errs, fmt.Errorf("Config.HeartbeatInterval must be positive, got %s", c.HeartbeatInterval))
	}
	if c.InFlight < 1 || c.InFlight > MaxInFlight {
		errs = append(errs, fmt.Errorf("Config.InFlight must be in [1, %d], got %d", MaxInFlight, c.InFlight))
	}
	if c.StandbyRetry <= 0 {
		errs = append(errs, fmt.Errorf("Config.StandbyRetry must be positive, got %s", c.StandbyRetry))
	}
	return errors.Join(errs...)
}

// ValidateName checks a slot or publication name.
func ValidateName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("%q: want 1 to 63 of a-z, 0-9 and _", name)
	}
	return nil
}

// DefaultName is the slot (and publication) name for an outbox in schema
// of database: "ferry_<database>_<schema>", lower-cased, other characters
// as "_", cut to 63.
func DefaultName(database, schema string) string {
	b := []byte("ferry_" + database + "_" + schema)
	for i, ch := range b {
		switch {
		case ch >= 'A' && ch <= 'Z':
			b[i] = ch + 'a' - 'A'
		case ch >= 'a' && ch <= 'z', ch >= '0' && ch <= '9', ch == '_':
		default:
			b[i] = '_'
		}
	}
	if len(b) > 63 {
		b = b[:63]
	}
	return string(b)
}
