package orders

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/agenttools"
)

// Names of the example's agent tools.
const (
	ToolCreateOrder  = "create_order"
	ToolSendReminder = "send_reminder"
)

// snippet:begin create-order
// CreateOrderArgs is create_order's input as a tool. There is no
// idempotency key among them: the host supplies it.
type CreateOrderArgs struct {
	UserID   string `json:"user_id" jsonschema:"the customer's user id: 1 to 128 of A-Z a-z 0-9 . _ -, starting with a letter or digit"`
	Amount   int64  `json:"amount" jsonschema:"the amount in the currency's smallest unit (yen, cents), 1 to 99999999"`
	Currency string `json:"currency" jsonschema:"JPY or USD"`
}

// Validate names every bad field before anything is written.
func (a CreateOrderArgs) Validate() error {
	if fields := checkDetails(a.UserID, a.Amount, a.Currency); len(fields) > 0 {
		return &ValidationError{Fields: fields}
	}
	return nil
}

// OrderPlaced is create_order's result.
type OrderPlaced struct {
	OrderID int64 `json:"order_id" jsonschema:"the new order's id; intent_status with aggregate_id set to it shows its charge and mail"`
}

// CreateOrderTool is create_order as an agent tool: the order row and its
// two intents (charge it, mail the confirmation) in one transaction. The
// card is charged and the mail sent by the consumers, once, later: never
// from the tool.
func CreateOrderTool() (agenttools.Tool, error) {
	return agenttools.New(agenttools.Def{
		Name: ToolCreateOrder, Title: "Create order",
		Description: "Places an order for a user and queues its card charge and confirmation mail. " +
			"Calling it again with the same idempotency key and arguments returns the same order; nothing is charged twice.",
	}, func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, in CreateOrderArgs) (OrderPlaced, error) {
		var id int64
		err := tx.QueryRow(ctx, insertOrderSQL, in.UserID, in.Amount, in.Currency, agenttools.KeyFromContext(ctx)).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			// The key placed an order outside the tool (the Go API).
			return OrderPlaced{}, fmt.Errorf("%w: an order with this key exists already", agenttools.ErrKeyConflict)
		}
		if err != nil {
			return OrderPlaced{}, fmt.Errorf("inserting order: %w", err)
		}
		charge, mail, err := orderEvents(ctx, nil, id, in.UserID, in.Amount, in.Currency)
		if err != nil {
			return OrderPlaced{}, err
		}
		if _, err := emit.EmitMessage(ctx, TopicChargeRequested, charge); err != nil {
			return OrderPlaced{}, err
		}
		if _, err := emit.EmitMessage(ctx, TopicMailRequested, mail); err != nil {
			return OrderPlaced{}, err
		}
		return OrderPlaced{OrderID: id}, nil
	})
}

// snippet:end create-order

// Bounds of send_reminder's delay.
const (
	DefaultReminderDelay = 3 * time.Minute
	MaxReminderMinutes   = 1440
)

// SendReminderArgs is send_reminder's input.
type SendReminderArgs struct {
	OrderID      int64 `json:"order_id" jsonschema:"the order to remind its customer of"`
	DelayMinutes int   `json:"delay_minutes,omitempty" jsonschema:"minutes from now, 1 to 1440; default 3"`
}

// Validate names every bad field before anything is written.
func (a SendReminderArgs) Validate() error {
	fields := map[string]string{}
	if a.OrderID <= 0 {
		fields["order_id"] = "must be an order id (greater than 0)"
	}
	if a.DelayMinutes < 0 || a.DelayMinutes > MaxReminderMinutes {
		fields["delay_minutes"] = fmt.Sprintf("must be 1 to %d (or left out for 3)", MaxReminderMinutes)
	}
	if len(fields) > 0 {
		return &agenttools.InputError{Fields: fields}
	}
	return nil
}

// ReminderScheduled is send_reminder's result.
type ReminderScheduled struct {
	OrderID   int64     `json:"order_id"`
	MessageID string    `json:"message_id" jsonschema:"the mail intent's id"`
	SendAt    time.Time `json:"send_at" jsonschema:"when the mail is due (it is relayed no sooner)"`
}

// snippet:begin send-reminder
// SendReminderTool schedules a reminder mail for an order, a few minutes
// from now: a delayed intent in the same outbox table, relayed when due.
func SendReminderTool() (agenttools.Tool, error) {
	return agenttools.New(agenttools.Def{
		Name: ToolSendReminder, Title: "Send order reminder",
		Description: "Schedules a reminder mail about an existing order, sent after a delay (3 minutes unless delay_minutes says otherwise).",
	}, func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, in SendReminderArgs) (ReminderScheduled, error) {
		var userID string
		var now time.Time
		err := tx.QueryRow(ctx, `SELECT user_id, now() FROM orders WHERE id = $1`, in.OrderID).Scan(&userID, &now)
		if errors.Is(err, pgx.ErrNoRows) {
			return ReminderScheduled{}, &agenttools.InputError{Fields: map[string]string{"order_id": "no such order"}}
		}
		if err != nil {
			return ReminderScheduled{}, fmt.Errorf("reading order: %w", err)
		}
		delay := DefaultReminderDelay
		if in.DelayMinutes > 0 {
			delay = time.Duration(in.DelayMinutes) * time.Minute
		}
		id, err := emit.Emit(ctx, TopicMailRequested, fmt.Sprint(in.OrderID), MailRequested{
			OrderID: in.OrderID, UserID: userID,
			Subject: fmt.Sprintf("A reminder about your order #%d", in.OrderID),
			Body:    fmt.Sprintf("Your order #%d is on its way.", in.OrderID),
		}, agenttools.After(delay))
		if err != nil {
			return ReminderScheduled{}, err
		}
		return ReminderScheduled{OrderID: in.OrderID, MessageID: id, SendAt: now.Add(delay)}, nil
	})
}

// snippet:end send-reminder

// Tools are the example's agent tools.
func Tools() ([]agenttools.Tool, error) {
	create, err := CreateOrderTool()
	if err != nil {
		return nil, err
	}
	remind, err := SendReminderTool()
	if err != nil {
		return nil, err
	}
	return []agenttools.Tool{create, remind}, nil
}
