package console

import (
	"bytes"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/pipeline/pgconfirm"
)

// Bounds of what a page shows: hostile or huge content stays readable.
const (
	pageSize        = 50
	maxCell         = 120
	maxDetailBytes  = 64 << 10
	latencyWindow   = 15 * time.Minute
	recentAuditRows = 100
)

func (c *Console) funcs() template.FuncMap {
	return template.FuncMap{
		"cut":  func(s string) string { return clean(s, maxCell) },
		"full": func(s string) string { return clean(s, maxDetailBytes) },
		"ago": func(t time.Time) string {
			if t.IsZero() {
				return "—"
			}
			return display.Age(time.Since(t)) + " ago"
		},
		"secs": func(s float64) string {
			return (time.Duration(s * float64(time.Second))).Round(time.Millisecond).String()
		},
		"ts":  func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
		"add": func(a, b int) int { return a + b },
		"deref": func(p any) any {
			switch v := p.(type) {
			case *float64:
				return *v
			case *int:
				return *v
			case *time.Time:
				return *v
			}
			return p
		},
	}
}

// clean is display.Escape keeping line breaks: html/template escapes
// markup, this keeps invisible or reordering characters from hiding what a
// reason says, and bounds it.
func clean(s string, max int) string { return display.Escape(s, max, true) }

func (c *Console) internal(w http.ResponseWriter, r *http.Request, err error) {
	c.cfg.Logger.ErrorContext(r.Context(), "console: a page failed", "path", r.URL.Path, "error", err)
	c.fail(w, r, http.StatusInternalServerError, "the page could not be built (the process's log says why)")
}

// flash is the result message the action redirected with, when the
// console itself wrote it (signed): a link cannot put words of its own in
// the green success banner.
// redirectFlash sends the browser to path (under the console's prefix)
// with text shown there: signed, so that a link made elsewhere cannot put
// words on a console page (flash checks it).
func (c *Console) redirectFlash(w http.ResponseWriter, r *http.Request, path, text string, extra url.Values) {
	q := url.Values{"flash": {text}, "sig": {c.mac("flash\x00" + text)}}
	for k, v := range extra {
		q[k] = v
	}
	http.Redirect(w, r, c.cfg.Prefix+path+"?"+q.Encode(), http.StatusSeeOther)
}

func (c *Console) flash(q url.Values) string {
	text := q.Get("flash")
	if text == "" || c.cfg.Token == "" || subtle.ConstantTimeCompare([]byte(q.Get("sig")), []byte(c.mac("flash\x00"+text))) != 1 {
		return ""
	}
	return text
}

// MaxActionRows bounds what one request acts on: a failing-rows action
// takes at most this many (the oldest first, the confirmation says how
// many more there are), and a poison store action over more runs as a
// background job (Config.MaxBackgroundRows) with a page of its own.
const MaxActionRows = 1000

// DefaultMaxBackgroundRows is Config.MaxBackgroundRows's default: what one
// confirmation of a poison store action can take, in the background.
const DefaultMaxBackgroundRows = 250_000

// newNonce is a single-use id (a background run's).
func newNonce() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}

// confirmToken binds a confirmation to its session (another session, or
// this one after logging out, cannot use it), its action and selection,
// and its nonce, under which pgconfirm keeps the ids it showed.
func (c *Console) confirmToken(r *http.Request, kind, act, selection, nonce string) string {
	return c.mac(strings.Join([]string{"confirm", c.csrf(r), kind, act, selection, nonce}, "\x00"))
}

// preview records what a confirmation page shows (the ids, under a new
// nonce, until Config.ConfirmTTL) and returns the form fields that name it
// and the signed token.
func (c *Console) preview(r *http.Request, p pgconfirm.Preview) (fields [][2]string, token string, err error) {
	nonce, _, err := pgconfirm.Save(r.Context(), c.pool, p, c.cfg.ConfirmTTL)
	if err != nil {
		return nil, "", err
	}
	return [][2]string{{"nonce", nonce}}, c.confirmToken(r, p.Kind, p.Action, p.Selection, nonce), nil
}

// ttl is how long a confirmation can be used, in words.
func (c *Console) ttl() string { return c.confirmTTL().String() }

// confirmTTL is how long a confirmation can be used.
func (c *Console) confirmTTL() time.Duration {
	if c.cfg.ConfirmTTL <= 0 {
		return pgconfirm.DefaultTTL
	}
	return c.cfg.ConfirmTTL
}

// errConfirmation is a confirmation that was given but cannot be used.
type errConfirmation struct{ error }

// confirmationFailed answers a confirmation that could not be read: 409
// with why when it expired or is unknown, 500 otherwise.
func (c *Console) confirmationFailed(w http.ResponseWriter, r *http.Request, err error) {
	var bad errConfirmation
	if errors.As(err, &bad) {
		c.fail(w, r, http.StatusConflict, bad.Error())
		return
	}
	c.internal(w, r, err)
}

// confirmed returns what the confirmation a form posts showed, when the
// form carries one signed for this session, this action and this
// selection: the action then takes those ids and nothing else. ok is
// false when there is none (or it was made for something else): show the
// preview. An expired or unknown confirmation is an errConfirmation.
func (c *Console) confirmed(r *http.Request, kind, act, selection string) (p pgconfirm.Preview, ok bool, err error) {
	got, nonce := r.PostForm.Get("confirm"), r.PostForm.Get("nonce")
	if got == "" || len(nonce) != 32 || subtle.ConstantTimeCompare([]byte(got), []byte(c.confirmToken(r, kind, act, selection, nonce))) != 1 {
		return p, false, nil
	}
	p, err = pgconfirm.Load(r.Context(), c.pool, nonce)
	if errors.Is(err, pgconfirm.ErrExpired) || errors.Is(err, pgconfirm.ErrUnknown) {
		return p, false, errConfirmation{err}
	}
	if err != nil {
		return p, false, err
	}
	if p.Kind != kind || p.Action != act || p.Selection != selection {
		return p, false, nil
	}
	return p, true, nil
}

// shownPayload is a payload as a detail page shows it: pretty JSON, or the
// bytes as text, the first maxDetailBytes only.
func shownPayload(payload []byte) (text string, isJSON, truncated bool) {
	if len(payload) > maxDetailBytes {
		payload, truncated = payload[:maxDetailBytes], true
	}
	var pretty bytes.Buffer
	if !truncated && json.Valid(payload) && json.Indent(&pretty, payload, "", "  ") == nil {
		return pretty.String(), true, false
	}
	return string(payload), false, truncated
}

// sortedHeaders are a message's headers as a detail page lists them, by key.
func sortedHeaders(h map[string]string) [][2]string {
	out := make([][2]string, 0, len(h))
	for k, v := range h {
		out = append(out, [2]string{k, v})
	}
	slices.SortFunc(out, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return out
}
