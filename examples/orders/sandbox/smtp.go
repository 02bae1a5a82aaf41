package sandbox

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"log"
	"net"
	"net/textproto"
	"sync"
	"time"

	"github.com/emersion/go-smtp"
)

// Mail is a message the SMTP sink received.
type Mail struct {
	From      string
	To        []string
	Subject   string
	MessageID string
	Data      []byte
}

// SMTPSink is an SMTP server that accepts every mail and keeps it.
type SMTPSink struct {
	srv *smtp.Server
	ln  net.Listener

	mu    sync.Mutex
	mails []Mail
}

// StartSMTPSink listens on addr ("127.0.0.1:0" for any free port).
func StartSMTPSink(addr string) (*SMTPSink, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("starting SMTP sink: %w", err)
	}
	s := &SMTPSink{ln: ln}
	s.srv = smtp.NewServer(sinkBackend{s})
	s.srv.Domain = "sink.ferry.local"
	s.srv.ReadTimeout = 10 * time.Second
	s.srv.WriteTimeout = 10 * time.Second
	s.srv.MaxMessageBytes = 1 << 20
	// Clients that die mid-session (fault-injection runs kill them) are
	// expected here, not news.
	s.srv.ErrorLog = log.New(io.Discard, "", 0)
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// Addr is the sink's host:port.
func (s *SMTPSink) Addr() string { return s.ln.Addr().String() }

// Close stops the sink.
func (s *SMTPSink) Close() error { return s.srv.Close() }

// Mails returns the mails received, in order.
func (s *SMTPSink) Mails() []Mail {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Mail(nil), s.mails...)
}

type sinkBackend struct{ sink *SMTPSink }

func (b sinkBackend) NewSession(*smtp.Conn) (smtp.Session, error) {
	return &sinkSession{sink: b.sink}, nil
}

type sinkSession struct {
	sink *SMTPSink
	from string
	to   []string
}

func (s *sinkSession) Mail(from string, _ *smtp.MailOptions) error { s.from = from; return nil }
func (s *sinkSession) Rcpt(to string, _ *smtp.RcptOptions) error   { s.to = append(s.to, to); return nil }
func (s *sinkSession) Reset()                                      { s.from, s.to = "", nil }
func (s *sinkSession) Logout() error                               { return nil }

func (s *sinkSession) Data(r io.Reader) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	m := Mail{From: s.from, To: s.to, Data: data}
	if hdr, err := textproto.NewReader(bufio.NewReader(bytes.NewReader(data))).ReadMIMEHeader(); err == nil {
		m.Subject, m.MessageID = hdr.Get("Subject"), hdr.Get("Message-ID")
	}
	s.sink.mu.Lock()
	s.sink.mails = append(s.sink.mails, m)
	s.sink.mu.Unlock()
	return nil
}
