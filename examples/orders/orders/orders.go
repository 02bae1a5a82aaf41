package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode"
	"unicode/utf8"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Bounds of Input.
const (
	// MaxAmount is the largest amount in the currency's smallest unit
	// (the payment provider's own limit for JPY and USD).
	MaxAmount            = 99_999_999
	MaxUserIDLength      = 128
	MaxIdempotencyKeyLen = 255
)

// Currencies the example accepts.
const (
	CurrencyJPY = "JPY"
	CurrencyUSD = "USD"
)

func validCurrency(c string) bool { return c == CurrencyJPY || c == CurrencyUSD }

// Errors of CreateOrder.
var (
	// ErrInvalidInput wraps every validation failure (see ValidationError).
	ErrInvalidInput = errors.New("invalid create_order input")
	// ErrIdempotencyKeyReused is returned when a key comes back with
	// different order details: replaying it would hide a bug in the caller.
	ErrIdempotencyKeyReused = errors.New("idempotency key was already used for a different order")
)

// ValidationError lists every invalid field of an Input.
type ValidationError struct {
	// Fields maps a field name (as in the JSON API) to what is wrong with it.
	Fields map[string]string
}

func (e *ValidationError) Error() string {
	parts := make([]string, 0, len(e.Fields))
	for _, f := range []string{"user_id", "amount", "currency", "idempotency_key"} {
		if msg, ok := e.Fields[f]; ok {
			parts = append(parts, f+": "+msg)
		}
	}
	return "invalid create_order input: " + strings.Join(parts, "; ")
}

// FieldErrors lets the tools runner name the fields (agenttools.InputError).
func (e *ValidationError) FieldErrors() map[string]string { return e.Fields }

// Unwrap makes errors.Is(err, ErrInvalidInput) hold.
func (e *ValidationError) Unwrap() error { return ErrInvalidInput }

// Input is create_order's input.
type Input struct {
	UserID         string
	Amount         int64 // in the currency's smallest unit; > 0
	Currency       string
	IdempotencyKey string
}

// Validate reports every invalid field at once, as a *ValidationError.
func (in Input) Validate() error {
	fields := checkDetails(in.UserID, in.Amount, in.Currency)
	checkText(fields, "idempotency_key", in.IdempotencyKey, MaxIdempotencyKeyLen)
	if len(fields) > 0 {
		return &ValidationError{Fields: fields}
	}
	return nil
}

// checkDetails checks an order's details (the API's and the tool's).
func checkDetails(userID string, amount int64, currency string) map[string]string {
	fields := map[string]string{}
	if err := CheckUserID(userID); err != nil {
		fields["user_id"] = err.Error()
	}
	switch {
	case amount <= 0:
		fields["amount"] = "must be greater than 0"
	case amount > MaxAmount:
		fields["amount"] = "must be at most " + strconv.Itoa(MaxAmount)
	}
	if !validCurrency(currency) {
		fields["currency"] = "must be JPY or USD"
	}
	return fields
}

// CheckUserID says what is wrong with a user id, or nil. A user id ends up
// in protocol lines (the mail handler makes it the local part of an SMTP
// recipient, the charge handler sends it to the provider), so it is held to
// a plain identifier: 1 to 128 of A-Z a-z 0-9 . _ -, starting with a letter
// or digit. No space, no angle bracket, no "@": nothing that could carry an
// ESMTP parameter or a second address. The API and the events' own
// validation both use it, since events can come from anywhere.
func CheckUserID(id string) error {
	switch {
	case id == "":
		return errors.New("is required")
	case len(id) > MaxUserIDLength:
		return fmt.Errorf("must be at most %d bytes", MaxUserIDLength)
	}
	for i, r := range id {
		alnum := r < utf8.RuneSelf && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9')
		if !alnum && (i == 0 || (r != '.' && r != '_' && r != '-')) {
			return errors.New("must be letters, digits, '.', '_' or '-', starting with a letter or digit")
		}
	}
	return nil
}

func checkText(fields map[string]string, name, v string, maxLen int) {
	switch {
	case v == "":
		fields[name] = "is required"
	case len(v) > maxLen:
		fields[name] = "must be at most " + strconv.Itoa(maxLen) + " bytes"
	case !utf8.ValidString(v):
		fields[name] = "must be valid UTF-8"
	case strings.IndexFunc(v, unicode.IsControl) >= 0:
		fields[name] = "must not contain control characters"
	}
}

// Result is create_order's answer.
type Result struct {
	OrderID int64 `json:"order_id"`
	// Deduped is true when the idempotency key had been seen: no new order
	// and no new events were written.
	Deduped bool `json:"deduped"`
}

// TxPublisher publishes events inside a transaction (pgoutbox.Outbox).
type TxPublisher interface {
	PublishEventsTx(ctx context.Context, tx wsql.ContextExecutor, events ...pipeline.Outgoing) error
}

// Service implements create_order. It is safe for concurrent use.
type Service struct {
	db     *sql.DB
	outbox TxPublisher
	logger *slog.Logger
	// chargeEvent, if set, builds the charge event in place of
	// ChargeEvents.NewEvent (SetChargeEvent).
	chargeEvent atomic.Pointer[ChargeEventFunc]
}

// ChargeEventFunc builds an order's charge event.
type ChargeEventFunc func(ctx context.Context, aggregateID string, e ChargeRequested) (*message.Message, error)

// SetChargeEvent makes the service publish its charge events with fn: a
// producer that writes another version of the event (a rolling deploy's
// new code, as the chaos run's version roll has it). Nil restores
// ChargeEvents.NewEvent.
func (s *Service) SetChargeEvent(fn ChargeEventFunc) {
	if fn == nil {
		s.chargeEvent.Store(nil)
		return
	}
	s.chargeEvent.Store(&fn)
}

// NewService returns a Service writing orders through db and events through outbox.
func NewService(db *sql.DB, outbox TxPublisher, logger *slog.Logger) (*Service, error) {
	if db == nil || outbox == nil {
		return nil, errors.New("orders: NewService needs a database and an outbox")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Service{db: db, outbox: outbox, logger: logger}, nil
}

// CreateOrder places an order in its own transaction; see CreateOrderTx.
func (s *Service) CreateOrder(ctx context.Context, in Input) (res Result, err error) {
	if err := in.Validate(); err != nil {
		return Result{}, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return Result{}, fmt.Errorf("beginning create_order transaction: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback() // the error that got us here is the one to report
		}
	}()
	// The relays wake once the order commits: not before (they would
	// find nothing), not inside (a NOTIFY there serializes commits).
	ctx, committed := pipeline.WithAfterCommit(ctx)
	res, err = s.CreateOrderTx(ctx, tx, in)
	if err != nil {
		return Result{}, err
	}
	if err := tx.Commit(); err != nil {
		return Result{}, fmt.Errorf("committing order: %w", err)
	}
	committed()
	s.logger.Info("order placed", "order_id", res.OrderID, "deduped", res.Deduped,
		"correlation_id", pipeline.CorrelationIDFromContext(ctx))
	return res, nil
}

// CreateOrderTx places an order as part of tx: it inserts the order and
// publishes stripe.charge and mail.send through the outbox, or, when the
// idempotency key was seen before with the same details, returns that order
// with Deduped set and writes nothing. Input is validated before any write.
func (s *Service) CreateOrderTx(ctx context.Context, tx *sql.Tx, in Input) (Result, error) {
	if err := in.Validate(); err != nil {
		return Result{}, err
	}
	var id int64
	// ON CONFLICT DO NOTHING waits for a concurrent insert of the same key
	// to commit or roll back, so two racing requests cannot both create it.
	err := tx.QueryRowContext(ctx, insertOrderSQL, in.UserID, in.Amount, in.Currency, in.IdempotencyKey).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return s.existing(ctx, tx, in)
	}
	if err != nil {
		return Result{}, fmt.Errorf("inserting order: %w", err)
	}
	charge, mail, err := orderEvents(ctx, s.chargeEvent.Load(), id, in.UserID, in.Amount, in.Currency)
	if err != nil {
		return Result{}, err
	}
	// Both events in one statement: one round trip more than the order alone.
	if err := s.outbox.PublishEventsTx(ctx, tx,
		pipeline.Outgoing{Topic: TopicChargeRequested, Msg: charge},
		pipeline.Outgoing{Topic: TopicMailRequested, Msg: mail}); err != nil {
		return Result{}, err
	}
	return Result{OrderID: id}, nil
}

// insertOrderSQL writes an order; no row comes back when its idempotency
// key is taken.
const insertOrderSQL = `INSERT INTO orders (user_id, amount, currency, idempotency_key)
	VALUES ($1, $2, $3, $4)
	ON CONFLICT (idempotency_key) DO NOTHING
	RETURNING id`

// orderEvents are an order's two intents: charge it, mail its
// confirmation. chargeEvent builds the charge event (nil: ChargeEvents.NewEvent).
func orderEvents(ctx context.Context, chargeEvent *ChargeEventFunc, id int64, userID string, amount int64, currency string) (charge, mail *message.Message, err error) {
	aggregate := strconv.FormatInt(id, 10)
	e := ChargeRequested{OrderID: id, UserID: userID, Amount: amount, Currency: currency}
	if chargeEvent != nil {
		charge, err = (*chargeEvent)(ctx, aggregate, e)
	} else {
		charge, err = ChargeEvents.NewEvent(ctx, aggregate, e)
	}
	if err != nil {
		return nil, nil, err
	}
	mail, err = pipeline.NewEvent(ctx, aggregate, MailRequested{
		OrderID: id, UserID: userID,
		Subject: fmt.Sprintf("Your order #%d", id),
		Body:    fmt.Sprintf("Thank you. Order #%d for %d %s is confirmed.", id, amount, currency),
	})
	return charge, mail, err
}

func (s *Service) existing(ctx context.Context, tx *sql.Tx, in Input) (Result, error) {
	var (
		id   int64
		prev Input
	)
	err := tx.QueryRowContext(ctx,
		`SELECT id, user_id, amount, currency FROM orders WHERE idempotency_key = $1`,
		in.IdempotencyKey).Scan(&id, &prev.UserID, &prev.Amount, &prev.Currency)
	if err != nil {
		return Result{}, fmt.Errorf("reading order of idempotency key: %w", err)
	}
	if prev.UserID != in.UserID || prev.Amount != in.Amount || prev.Currency != in.Currency {
		return Result{}, fmt.Errorf("%w (order %d)", ErrIdempotencyKeyReused, id)
	}
	return Result{OrderID: id, Deduped: true}, nil
}

// CreateOrderInTx is CreateOrder on a pgx pool with the events written in
// the same round trip as the COMMIT (pgoutbox.Outbox.InTx): the outbox
// costs the bytes of its INSERT, not a round trip. Same contract as
// CreateOrder: validated before any write, the same key and details
// deduplicated, a key reused with other details refused.
func CreateOrderInTx(ctx context.Context, ob *pgoutbox.Outbox, pool *pgxpool.Pool, in Input) (Result, error) {
	if err := in.Validate(); err != nil {
		return Result{}, err
	}
	var res Result
	err := ob.InTx(ctx, pool, func(ctx context.Context, q pgoutbox.Querier, p *pgoutbox.Pending) error {
		var id int64
		err := q.QueryRow(ctx, insertOrderSQL, in.UserID, in.Amount, in.Currency, in.IdempotencyKey).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			var prev Input
			if err := q.QueryRow(ctx, `SELECT id, user_id, amount, currency FROM orders WHERE idempotency_key = $1`, in.IdempotencyKey).
				Scan(&id, &prev.UserID, &prev.Amount, &prev.Currency); err != nil {
				return fmt.Errorf("reading order of idempotency key: %w", err)
			}
			if prev.UserID != in.UserID || prev.Amount != in.Amount || prev.Currency != in.Currency {
				return fmt.Errorf("%w (order %d)", ErrIdempotencyKeyReused, id)
			}
			res = Result{OrderID: id, Deduped: true}
			return nil
		}
		if err != nil {
			return fmt.Errorf("inserting order: %w", err)
		}
		charge, mail, err := orderEvents(ctx, nil, id, in.UserID, in.Amount, in.Currency)
		if err != nil {
			return err
		}
		res = Result{OrderID: id}
		return p.PublishEvents(ctx, pipeline.Outgoing{Topic: TopicChargeRequested, Msg: charge}, pipeline.Outgoing{Topic: TopicMailRequested, Msg: mail})
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}
