package console

import (
	"html/template"
	"net/url"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgjobs"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/tenancy"
)

// chrome is what every page's layout reads (head and foot): set by
// render, never by a page.
type chrome struct {
	Prefix string
	Authed bool
	CanAct bool
	CSRF   string
	Page   string
	Here   string
	// Tenants shows the tenants page in the navigation (Config.Tenants).
	Tenants bool
}

func (c *chrome) setChrome(x chrome) { *c = x }

// pageData is a page's typed data: its own fields and the chrome. A
// template that names a field its page does not have fails its test,
// instead of rendering nothing from a map.
type pageData interface{ setChrome(chrome) }

type loginPage struct {
	chrome
	Off, Wrong bool
	Next       string
}

type errorPage struct {
	chrome
	Message string
	Status  int
}

type overviewPage struct {
	chrome
	O overview
}

type poisonPage struct {
	chrome
	Error        string
	Q            url.Values
	Groups       []pgpoison.Group
	Records      []pgpoison.Record
	Total        int
	Older, Newer template.URL
	FilterQuery  string
	FilterFields [][2]string
	Flash        string
	// Undo is the run of the discard just done, for its Undo button.
	Undo string
}

type heldHeadPage struct {
	chrome
	H         pgheld.HeadMessage
	Route     string
	Payload   string
	Truncated bool
	Headers   [][2]string
	History   []pipeline.FailedAttempt
	Current   asCurrent
	// Waiting is how many messages wait behind the head in Queue; nil
	// with Behind saying why it is not known.
	Waiting *int
	Queue   string
	Behind  string
	Flash   string
}

type searchPage struct {
	chrome
	Q     string
	Error string
	Found *pgstatus.Found
}

type handlersPage struct {
	chrome
	Rows  []handlerRow
	Flash string
}

type tenantsPage struct {
	chrome
	Rows       []tenancy.Status
	NeedAHuman int
	Flash      string
}

type jobPage struct {
	chrome
	Job pgjobs.Job
	// Undo is the finished discard's run, for its Undo button.
	Undo string
}

type detailPage struct {
	chrome
	D detail
}

type confirmPage struct {
	chrome
	Action, Scope, Within string
	// Count is what the action will take (at most MaxActionRows, the
	// oldest); Total what the selection holds now.
	Count, Total int
	Fields       [][2]string
	Confirm      string
	// Background: the action takes more than one request should
	// (MaxActionRows) and runs as a job with a page of its own.
	Background bool
	// TTL is how long the confirmation can be used.
	TTL string
}

type failingPage struct {
	chrome
	Error  string
	Q      url.Values
	Groups []pgoutbox.FailingGroup
	Rows   []pgoutbox.FailingRow
	Next   template.URL
	Flash  string
}

type auditPage struct {
	chrome
	Entries []pgaudit.Entry
	// Undo is, per entry, the discard run its Undo button puts back.
	Undo []string
}

type retryingPage struct {
	chrome
	Groups []pgstatus.RetryGroup
	Total  int
	Flash  string
}

type outboxConfirmPage struct {
	chrome
	Kind, Action, Scope string
	Count, Total        int
	Fields              [][2]string
	Confirm             string
	TTL                 string
}

type outboxRowPage struct {
	chrome
	Row   outboxRow
	Flash string
}
