// Package mail is the mail.send consumer: it sends the order mail over SMTP.
//
// SMTP has no idempotency key, so exactly-once rests on the ledger around
// the handler; the message's idempotency key still goes out as the mail's
// Message-ID, which lets a receiving system drop the rare duplicate left by
// a crash between the SMTP DATA and the ledger commit.
package mail

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	netmail "net/mail"
	"net/smtp"
	"net/textproto"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
)

// HandlerName is the route name (and queue name) of the mail handler.
const HandlerName = "notifications.mail"

// Defaults of Config.
const (
	DefaultFrom            = "orders@ferry.local"
	DefaultRecipientDomain = "example.com"
	DefaultTimeout         = 10 * time.Second
)

// Mail is one message to send.
type Mail struct {
	From, To, Subject, Body string
	MessageID               string
}

// Sender sends a mail.
type Sender interface {
	Send(ctx context.Context, m Mail) error
}

// Config configures the mail route.
type Config struct {
	// From is the sender address. Default "orders@ferry.local".
	From string
	// RecipientDomain turns a user id into an address (user@domain), since
	// the example has no user directory. Default "example.com".
	RecipientDomain string
}

// Validate checks c as Route will use it (defaults applied), naming the
// fields; a bad sender or domain fails the start instead of poisoning
// every mail.
func (c Config) Validate() error {
	var errs []error
	if c.From != "" {
		if err := checkAddress(c.From); err != nil {
			errs = append(errs, fmt.Errorf("From %q: %w", c.From, errors.Unwrap(err)))
		}
	}
	if c.RecipientDomain != "" {
		if _, err := Address("user", c.RecipientDomain); err != nil {
			errs = append(errs, fmt.Errorf("RecipientDomain %q: not a mail domain (user@%s is %w)", c.RecipientDomain, c.RecipientDomain, errors.Unwrap(err)))
		}
	}
	return errors.Join(errs...)
}

// Route is the mail.send route, sending through s.
func Route(s Sender, cfg Config, logger *slog.Logger) handlers.Route {
	if cfg.From == "" {
		cfg.From = DefaultFrom
	}
	if cfg.RecipientDomain == "" {
		cfg.RecipientDomain = DefaultRecipientDomain
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return handlers.Route{
		Name:  HandlerName,
		Topic: orders.TopicMailRequested,
		Handler: handlers.Typed(func(ctx context.Context, e *orders.MailRequested) error {
			key, err := handlers.IdempotencyKey(ctx)
			if err != nil {
				return err
			}
			to, err := Address(e.UserID, cfg.RecipientDomain)
			if err != nil {
				return pipeline.Permanent(fmt.Errorf("mailing order %d: %w", e.OrderID, err))
			}
			m := Mail{
				From: cfg.From, To: to,
				Subject: e.Subject, Body: e.Body,
				MessageID: "<" + key + "@ferry>",
			}
			if err := s.Send(ctx, m); err != nil {
				return fmt.Errorf("mailing order %d: %w", e.OrderID, err)
			}
			// The order id says which mail; the address is personal data
			// and stays out of the logs.
			logger.InfoContext(ctx, "order mail sent", "order_id", e.OrderID)
			return nil
		}),
	}
}

// SMTPSender sends through an SMTP server without authentication (a local
// relay or sidecar, as is usual next to a service).
type SMTPSender struct {
	Addr    string
	Timeout time.Duration
}

// NewSMTPSender returns a sender to the SMTP server at addr (host:port).
func NewSMTPSender(addr string) (*SMTPSender, error) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("SMTP address must be host:port, got %q: %w", addr, err)
	}
	return &SMTPSender{Addr: addr, Timeout: DefaultTimeout}, nil
}

var errHeaderInjection = errors.New("mail header contains a line break")

// Address builds local@domain with a real address parser and refuses what
// does not come back from it unchanged: anything that could carry a second
// address, a display name, a comment or an ESMTP parameter into the
// RCPT TO line ("a> NOTIFY=SUCCESS ORCPT=rfc822;x@evil").
func Address(local, domain string) (string, error) {
	addr := local + "@" + domain
	if err := checkAddress(addr); err != nil {
		return "", err
	}
	return addr, nil
}

func checkAddress(addr string) error {
	parsed, err := netmail.ParseAddress(addr)
	if err != nil || parsed.Name != "" || parsed.Address != addr ||
		strings.ContainsAny(addr, "<> \t\r\n\"") || strings.Count(addr, "@") != 1 {
		return pipeline.Permanent(errors.New("not a plain mail address (local@domain)"))
	}
	return nil
}

// Send implements Sender. Addresses are checked before connecting
// (Address's rule); a 5xx reply is Permanent, since the server has judged
// the mail itself and says so for good (RFC 5321 §4.2.1), while 4xx and
// connection failures are worth a retry. Addresses in the server's replies
// are redacted from the error, which ends up in logs and poison reasons.
func (s *SMTPSender) Send(ctx context.Context, m Mail) error {
	for _, h := range []string{m.From, m.To, m.Subject, m.MessageID} {
		if strings.ContainsAny(h, "\r\n") {
			return pipeline.Permanent(errHeaderInjection)
		}
	}
	for _, a := range []string{m.From, m.To} {
		if err := checkAddress(a); err != nil {
			return err
		}
	}
	return classify(s.send(ctx, m))
}

// classify marks permanent SMTP replies and redacts addresses.
func classify(err error) error {
	if err == nil {
		return nil
	}
	redacted := &redactedError{msg: RedactAddresses(err.Error()), err: err}
	var tp *textproto.Error
	if errors.As(err, &tp) && tp.Code >= 500 && tp.Code < 600 {
		return pipeline.Permanent(redacted)
	}
	return redacted
}

// redactedError keeps the cause for errors.As, with a message whose
// addresses are hidden.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

// RedactAddresses masks the personal data in an SMTP error: Ferry's one
// redaction (pipeline.RedactPersonal), quoted local parts, address
// literals and phone numbers included.
func RedactAddresses(s string) string { return pipeline.RedactPersonal(s) }

func (s *SMTPSender) send(ctx context.Context, m Mail) error {
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", s.Addr)
	if err != nil {
		return fmt.Errorf("connecting to SMTP server %s: %w", s.Addr, err)
	}
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	host, _, _ := net.SplitHostPort(s.Addr)
	c, err := smtp.NewClient(conn, host)
	if err != nil {
		conn.Close()
		return fmt.Errorf("SMTP greeting from %s: %w", s.Addr, err)
	}
	defer c.Close()
	if err := c.Mail(m.From); err != nil {
		return fmt.Errorf("SMTP MAIL FROM: %w", err)
	}
	if err := c.Rcpt(m.To); err != nil {
		return fmt.Errorf("SMTP RCPT TO: %w", err)
	}
	w, err := c.Data()
	if err != nil {
		return fmt.Errorf("SMTP DATA: %w", err)
	}
	body := strings.ReplaceAll(m.Body, "\n", "\r\n")
	msg := "From: " + m.From + "\r\nTo: " + m.To + "\r\nSubject: " + m.Subject +
		"\r\nMessage-ID: " + m.MessageID + "\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n" + body + "\r\n"
	if _, err := w.Write([]byte(msg)); err != nil {
		return fmt.Errorf("SMTP writing message: %w", err)
	}
	if err := w.Close(); err != nil {
		return fmt.Errorf("SMTP ending message: %w", err)
	}
	// The server has accepted the mail: a failed QUIT must not make the
	// handler fail, or the retry would send it again.
	_ = c.Quit()
	return nil
}
