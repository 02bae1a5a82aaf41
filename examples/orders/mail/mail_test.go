package mail_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"

	gosmtp "github.com/emersion/go-smtp"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/orders/mail"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/examples/orders/sandbox"
	"github.com/ferry-dev/ferry/pipeline"
)

func TestSMTPSenderDelivers(t *testing.T) {
	t.Parallel()
	sink, err := sandbox.StartSMTPSink("127.0.0.1:0")
	require.NoError(t, err)
	defer sink.Close()
	s, err := mail.NewSMTPSender(sink.Addr())
	require.NoError(t, err)
	require.NoError(t, s.Send(context.Background(), mail.Mail{
		From: "a@ferry.local", To: "b@example.com", Subject: "Hi", Body: "line 1\nline 2", MessageID: "<k@ferry>",
	}))
	got := sink.Mails()
	require.Len(t, got, 1)
	require.Equal(t, []string{"b@example.com"}, got[0].To)
	require.Equal(t, "Hi", got[0].Subject)
	require.Equal(t, "<k@ferry>", got[0].MessageID)
}

func TestSMTPSenderRefusesHeaderInjection(t *testing.T) {
	t.Parallel()
	s, err := mail.NewSMTPSender("127.0.0.1:1")
	require.NoError(t, err)
	err = s.Send(context.Background(), mail.Mail{From: "a@x", To: "b@x", Subject: "Hi\r\nBcc: everyone@x"})
	require.True(t, pipeline.IsPermanent(err))

	err = s.Send(context.Background(), mail.Mail{From: "a@x", To: "b@x", Subject: "Hi"})
	require.Error(t, err, "nothing listens on port 1")
	require.False(t, pipeline.IsPermanent(err), "an unreachable server is worth a retry")

	_, err = mail.NewSMTPSender("no-port")
	require.Error(t, err)
}

// refusingBackend answers RCPT TO with the configured reply, as a real
// server does for an unknown user or a malformed address.
type refusingBackend struct{ code int }

func (b refusingBackend) NewSession(*gosmtp.Conn) (gosmtp.Session, error) {
	return &refusingSession{code: b.code}, nil
}

type refusingSession struct{ code int }

func (s *refusingSession) Mail(string, *gosmtp.MailOptions) error { return nil }
func (s *refusingSession) Rcpt(to string, _ *gosmtp.RcptOptions) error {
	return &gosmtp.SMTPError{Code: s.code, EnhancedCode: gosmtp.EnhancedCode{s.code / 100, 1, 1}, Message: "<" + to + ">: user unknown"}
}
func (s *refusingSession) Data(io.Reader) error { return nil }
func (s *refusingSession) Reset()               {}
func (s *refusingSession) Logout() error        { return nil }

func refusingServer(t *testing.T, code int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := gosmtp.NewServer(refusingBackend{code: code})
	srv.Domain = "localhost"
	srv.AllowInsecureAuth = true
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// 5xx replies are permanent (poisoned at once, with the reason); 4xx are
// worth a retry. Either way the address in the reply is redacted.
func TestSMTPRepliesAreClassifiedAndRedacted(t *testing.T) {
	t.Parallel()
	for code, permanent := range map[int]bool{550: true, 501: true, 553: true, 451: false, 421: false} {
		s, err := mail.NewSMTPSender(refusingServer(t, code))
		require.NoError(t, err)
		err = s.Send(context.Background(), mail.Mail{From: "orders@ferry.local", To: "alice@example.com", Subject: "Hi", MessageID: "<k@ferry>"})
		require.Error(t, err, "%d", code)
		require.Equal(t, permanent, pipeline.IsPermanent(err), "%d: %v", code, err)
		require.Contains(t, err.Error(), fmt.Sprint(code))
		require.NotContains(t, err.Error(), "alice", "%d: the address stays out of logs and poison reasons: %v", code, err)
	}
}

// A server's reply quotes addresses in every form RFC 5321 allows, and a
// phone number now and then: the sender's errors show none of them (one
// redaction, pipeline.RedactPersonal, the same intent_status uses).
func TestRedactAddressesCoversEveryForm(t *testing.T) {
	t.Parallel()
	for _, pii := range []string{`"Dave Smith"@example.com`, "dave@[10.0.0.1]", "dave@example.com", "+1 555 123 4567", "(555) 123-4567"} {
		got := mail.RedactAddresses("550 5.1.1 <" + pii + ">: mailbox unavailable")
		require.NotContains(t, got, pii)
		require.NotContains(t, got, "Dave")
		require.NotContains(t, got, "dave")
		require.Contains(t, got, "550 5.1.1")
	}
}

// Recipients are built with a real address parser: what could carry an
// ESMTP parameter or a second address into RCPT TO is refused before any
// connection, as Permanent.
func TestAddressRefusesInjection(t *testing.T) {
	t.Parallel()
	addr, err := mail.Address("alice", "example.com")
	require.NoError(t, err)
	require.Equal(t, "alice@example.com", addr)
	for _, local := range []string{"a> NOTIFY=SUCCESS ORCPT=rfc822;x@evil", "a>", "<a", "a b", "a@b", `"a"`, "a\r\nRCPT TO:<x@evil>", "", "Name <a"} {
		_, err := mail.Address(local, "example.com")
		require.Error(t, err, "%q", local)
		require.True(t, pipeline.IsPermanent(err))
	}
	sink, err := sandbox.StartSMTPSink("127.0.0.1:0")
	require.NoError(t, err)
	defer sink.Close()
	s, err := mail.NewSMTPSender(sink.Addr())
	require.NoError(t, err)
	err = s.Send(context.Background(), mail.Mail{From: "a@ferry.local", To: "a> NOTIFY=SUCCESS ORCPT=rfc822;x@evil", Subject: "Hi"})
	require.True(t, pipeline.IsPermanent(err))
	require.Empty(t, sink.Mails(), "nothing reached the server")

	// A mail.send event with such a user id is refused by its own validation.
	require.Error(t, orders.MailRequested{OrderID: 1, UserID: "a> NOTIFY=SUCCESS", Subject: "x"}.Validate())
	require.Error(t, orders.ChargeRequested{OrderID: 1, UserID: "a b", Amount: 1, Currency: "JPY"}.Validate())
	require.NoError(t, orders.MailRequested{OrderID: 1, UserID: "alice.b-c_d", Subject: "x"}.Validate())
}
