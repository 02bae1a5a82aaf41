// Package ordersapp composes the orders example on Ferry's runtime: its
// configuration, its route table (charge and mail), its HTTP API
// (POST /orders) and its migrations. cmd/ferry runs it; an application of
// your own has a package like this one (see examples/invoices).
package ordersapp

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/examples/orders/charge"
	"github.com/ferry-dev/ferry/examples/orders/mail"
	"github.com/ferry-dev/ferry/examples/orders/migrations"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	ferrymigrations "github.com/ferry-dev/ferry/migrations"
)

// Defaults of Config.
const (
	DefaultPaymentURL = "http://127.0.0.1:12111"
	DefaultSMTPAddr   = "127.0.0.1:2525"
)

// Config is the example's own configuration, beside app.Config.
type Config struct {
	// PaymentURL is the payment provider's base URL. FERRY_PAYMENT_URL,
	// default http://127.0.0.1:12111 (`ferry sandbox`).
	PaymentURL string
	// SMTPAddr is the SMTP server (host:port). FERRY_SMTP_ADDR, default
	// 127.0.0.1:2525 (`ferry sandbox`).
	SMTPAddr string
	// Mail configures the mail handler. FERRY_MAIL_FROM, FERRY_MAIL_RECIPIENT_DOMAIN.
	Mail mail.Config
}

// EnvVars documents the example's variables, for `ferry help config`.
func EnvVars() []app.EnvVar {
	return []app.EnvVar{
		{Name: "FERRY_PAYMENT_URL", Default: DefaultPaymentURL, Doc: "orders example: payment provider base URL"},
		{Name: "FERRY_SMTP_ADDR", Default: DefaultSMTPAddr, Doc: "orders example: SMTP server host:port"},
		{Name: "FERRY_MAIL_FROM", Default: mail.DefaultFrom, Doc: "orders example: sender of order mails"},
		{Name: "FERRY_MAIL_RECIPIENT_DOMAIN", Default: mail.DefaultRecipientDomain, Doc: "orders example: domain appended to user ids for mail"},
	}
}

// ConfigFromEnv reads the example's variables over the defaults.
func ConfigFromEnv() (Config, error) { return ConfigFromLookup(os.LookupEnv) }

// ConfigFromLookup is ConfigFromEnv with another source of variables.
func ConfigFromLookup(lookup func(string) (string, bool)) (Config, error) {
	get := func(name string) string {
		v, _ := lookup(name)
		return strings.TrimSpace(v)
	}
	c := Config{
		PaymentURL: get("FERRY_PAYMENT_URL"),
		SMTPAddr:   get("FERRY_SMTP_ADDR"),
		Mail:       mail.Config{From: get("FERRY_MAIL_FROM"), RecipientDomain: get("FERRY_MAIL_RECIPIENT_DOMAIN")},
	}
	c = c.WithDefaults()
	return c, c.Validate()
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.PaymentURL == "" {
		c.PaymentURL = DefaultPaymentURL
	}
	if c.SMTPAddr == "" {
		c.SMTPAddr = DefaultSMTPAddr
	}
	return c
}

// Validate reports every problem at once, naming the variable.
func (c Config) Validate() error {
	var errs []error
	if _, err := charge.NewHTTPClient(c.PaymentURL); err != nil {
		errs = append(errs, fmt.Errorf("FERRY_PAYMENT_URL: %w", err))
	}
	if _, err := mail.NewSMTPSender(c.SMTPAddr); err != nil {
		errs = append(errs, fmt.Errorf("FERRY_SMTP_ADDR: %w", err))
	}
	if c.Mail.From != "" {
		if err := (mail.Config{From: c.Mail.From}).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("FERRY_MAIL_FROM: %w", err))
		}
	}
	if c.Mail.RecipientDomain != "" {
		if err := (mail.Config{RecipientDomain: c.Mail.RecipientDomain}).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("FERRY_MAIL_RECIPIENT_DOMAIN: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Routes is the example's route table: the application's contents page.
func Routes(c Config) func(app.Deps) ([]handlers.Route, error) {
	return func(d app.Deps) ([]handlers.Route, error) {
		payments, err := charge.NewHTTPClient(c.PaymentURL)
		if err != nil {
			return nil, fmt.Errorf("FERRY_PAYMENT_URL: %w", err)
		}
		smtp, err := mail.NewSMTPSender(c.SMTPAddr)
		if err != nil {
			return nil, fmt.Errorf("FERRY_SMTP_ADDR: %w", err)
		}
		return []handlers.Route{
			charge.Route(payments, d.Logger),   // stripe.charge → payment provider (ordered per order)
			mail.Route(smtp, c.Mail, d.Logger), // mail.send → SMTP
		}, nil
	}
}

// NewService is create_order on a's database and outbox.
func NewService(a *app.App) (*orders.Service, error) {
	return orders.NewService(a.DB(), a.Outbox(), nil)
}

// HTTP is the example's HTTP API: POST /orders (a thin wrapper over the
// create_order tool) and GET /healthz. The tools themselves are served
// beside it, at /mcp and /tools.
func HTTP(a *app.App) (http.Handler, error) {
	if a.Tools() == nil {
		return nil, errors.New("ordersapp: the HTTP API needs the example's tools (Options.Tools)")
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", a.TraceHTTP("POST /orders", orders.Handler(a.Tools(), nil)))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	// Unknown paths and methods answer in the API's JSON error envelope too.
	return orders.JSONErrors(mux), nil
}

// Options are app.Options for the example: its routes, its HTTP API and
// its migrations. Set Logger, Migrate and the rest on the result.
func Options(c Config) app.Options {
	return app.Options{Routes: Routes(c), HTTP: HTTP, Tools: Tools, Migrations: []ferrymigrations.Set{migrations.Set}, Events: []evolve.Schema{orders.ChargeEvents}}
}

// Tools are the example's agent tools: create_order and send_reminder.
func Tools(app.Deps) ([]agenttools.Tool, error) { return orders.Tools() }
