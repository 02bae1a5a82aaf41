package orders

import (
	"errors"
	"fmt"
	"strings"
	"unicode"

	"github.com/ferry-dev/ferry/evolve"
)

// Topics of the events create_order publishes.
const (
	TopicChargeRequested = "stripe.charge"
	TopicMailRequested   = "mail.send"
)

// ChargeEvents is stripe.charge's version chain: version 1, the only one
// so far. The charge route decodes through it and create_order publishes
// with it, so that a version 2 is a type and a step away
// (docs/library.md, Events that change).
var ChargeEvents = mustChain(evolve.New[ChargeRequested](TopicChargeRequested, "1"))

func mustChain[T any](c *evolve.Chain[T], err error) *evolve.Chain[T] {
	if err != nil {
		panic(err) // a chain that cannot work stops the program at init, like regexp.MustCompile
	}
	return c
}

// ChargeRequested asks for the order's amount to be charged (topic stripe.charge).
type ChargeRequested struct {
	OrderID  int64  `json:"order_id"`
	UserID   string `json:"user_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// Validate checks the fields a charge cannot do without.
func (e ChargeRequested) Validate() error {
	var errs []error
	if e.OrderID <= 0 {
		errs = append(errs, errors.New("order_id is missing"))
	}
	if e.UserID == "" {
		errs = append(errs, errors.New("user_id is missing"))
	} else if err := CheckUserID(e.UserID); err != nil {
		errs = append(errs, fmt.Errorf("user_id %w", err))
	}
	if e.Amount <= 0 || e.Amount > MaxAmount {
		errs = append(errs, fmt.Errorf("amount %d is out of range", e.Amount))
	}
	if !validCurrency(e.Currency) {
		errs = append(errs, fmt.Errorf("currency %q is not supported", e.Currency))
	}
	return errors.Join(errs...)
}

// MailRequested asks for the order confirmation mail (topic mail.send).
type MailRequested struct {
	OrderID int64  `json:"order_id"`
	UserID  string `json:"user_id"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// Validate checks the fields a mail cannot do without.
func (e MailRequested) Validate() error {
	var errs []error
	if e.OrderID <= 0 {
		errs = append(errs, errors.New("order_id is missing"))
	}
	if e.UserID == "" {
		errs = append(errs, errors.New("user_id is missing"))
	} else if err := CheckUserID(e.UserID); err != nil {
		errs = append(errs, fmt.Errorf("user_id %w", err))
	}
	if e.Subject == "" {
		errs = append(errs, errors.New("subject is missing"))
	} else if strings.IndexFunc(e.Subject, unicode.IsControl) >= 0 {
		errs = append(errs, errors.New("subject holds a control character"))
	}
	return errors.Join(errs...)
}
