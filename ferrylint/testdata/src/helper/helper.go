// Package helper does side effects a tool body must not reach.
package helper

import (
	"net/http"
	"strings"
)

// Notify posts to a webhook.
func Notify(url string) error { // want Notify:`sideEffect\(HTTP call net/http.Post\)`
	_, err := http.Post(url, "text/plain", strings.NewReader("hi"))
	return err
}

// Relay reaches the effect through another helper.
func Relay(url string) error { return Notify(url) } // want Relay:`sideEffect\(helper.Notify → HTTP call net/http.Post\)`

// Allowed is suppressed at its source, with a reason.
func Allowed(url string) error {
	//ferry:allow-side-effect reading a public, idempotent health endpoint
	_, err := http.Get(url)
	return err
}

// Pure has no effect.
func Pure(s string) string { return strings.ToUpper(s) }
