package console

import (
	"crypto/subtle"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// askPage asks before an action on one thing (pause, resume, a held
// head's retry now, a route's held heads, an undo): what it will do, and
// to how many, as every action of the console does first. Its token binds
// the session, the action's words and the time it was asked (the
// confirmation expires after Config.ConfirmTTL); a form or a link that
// posts the action without it only gets this page.
type askPage struct {
	chrome
	Title, Message, Button, Cancel string
	// Count, if set, is how many the action takes.
	Count int
	// Path is where the confirmation posts (under the console's prefix).
	Path   string
	Fields [][2]string
	TTL    string
}

func (c *Console) askToken(r *http.Request, at string, words []string) string {
	return c.mac(strings.Join(append([]string{"ask", c.csrf(r), at}, words...), "\x00"))
}

// asked reports whether r's form carries a confirmation of the action
// that words describe, made for this session within Config.ConfirmTTL.
func (c *Console) asked(r *http.Request, words ...string) bool {
	got, at := r.PostForm.Get("confirm"), r.PostForm.Get("asked_at")
	sec, err := strconv.ParseInt(at, 10, 64)
	if got == "" || err != nil {
		return false
	}
	age := time.Since(time.Unix(sec, 0))
	if age < -time.Minute || age > c.confirmTTL() {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(c.askToken(r, at, words))) == 1
}

// ask shows the confirmation page of the action words describe; fields
// are the action's form fields, posted again with the confirmation.
func (c *Console) ask(w http.ResponseWriter, r *http.Request, p askPage, words ...string) {
	at := strconv.FormatInt(time.Now().Unix(), 10)
	p.Fields = append(p.Fields, [2]string{"asked_at", at}, [2]string{"confirm", c.askToken(r, at, words)})
	p.TTL = c.ttl()
	c.render(w, r, "ask", &p)
}
