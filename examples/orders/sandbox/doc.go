// Package sandbox runs, in process, the outside world that `ferry demo` and
// the tests talk to: a payment provider over HTTP and an SMTP server. Both
// record everything that arrives, so a duplicate effect is observable
// instead of hidden.
//
// They are real servers on loopback ports, reached through the same HTTP and
// SMTP clients production uses.
package sandbox

// World is the outside world of one run: a payment provider and an SMTP
// sink on free loopback ports.
type World struct {
	Payments *PaymentProvider
	SMTP     *SMTPSink
}

// StartWorld starts both servers.
func StartWorld() (*World, error) {
	p, err := StartPaymentProvider("127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s, err := StartSMTPSink("127.0.0.1:0")
	if err != nil {
		p.Close()
		return nil, err
	}
	return &World{Payments: p, SMTP: s}, nil
}

// Close stops both servers.
func (w *World) Close() {
	w.Payments.Close()
	w.SMTP.Close()
}
