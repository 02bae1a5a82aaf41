package mail_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/examples/orders/mail"
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
