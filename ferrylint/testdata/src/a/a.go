package a

import (
	"context"
	"net/http"
	"net/smtp"
	"os/exec"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"helper"
)

type in struct{}
type out struct{}

var pool *pgxpool.Pool

func tools1() {
	// Direct calls in the body passed to agenttools.New.
	_, _ = agenttools.New(agenttools.Def{Name: "direct"}, func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, _ in) (out, error) {
		_, _ = http.Get("https://payments.example/charge")                  // want `side effect in a tool body: HTTP call net/http.Get`
		_ = smtp.SendMail("mail:25", nil, "a@x", []string{"b@x"}, nil)      // want `side effect in a tool body: SMTP net/smtp.SendMail`
		_ = exec.Command("rm", "-rf", "/").Run()                            // want `process os/exec.Command` `process os/exec.\(Cmd\).Run`
		_, _ = pool.Exec(ctx, "UPDATE accounts SET charged = true")         // want `database call outside the tool's transaction`
		_, _ = tx.Exec(ctx, "INSERT INTO orders DEFAULT VALUES")            // the tool's own transaction: fine
		_, _ = emit.Emit(ctx, "stripe.charge", "1", map[string]int{"a": 1}) // the Emitter: fine
		return out{}, nil
	})

	// Through helpers in another package, one and two calls deep.
	_, _ = agenttools.New(agenttools.Def{Name: "helpers"}, func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, _ in) (out, error) {
		_ = helper.Notify("https://hooks.example")   // want `helper.Notify → HTTP call net/http.Post`
		_ = helper.Relay("https://hooks.example")    // want `helper.Relay → helper.Notify → HTTP call net/http.Post`
		_ = helper.Allowed("https://status.example") // suppressed at its source
		_ = helper.Pure("x")
		_ = localHelper() // want `a.localHelper → HTTP call net/http.Get`
		return out{}, nil
	})

	// Suppressions: with a reason, and without one.
	_, _ = agenttools.New(agenttools.Def{Name: "suppressed"}, func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, _ in) (out, error) {
		//ferry:allow-side-effect the provider's read-only quote endpoint, no effect
		_, _ = http.Get("https://payments.example/quote")
		//ferry:allow-side-effect
		_, _ = http.Get("https://payments.example/quote") // want `//ferry:allow-side-effect needs a reason`
		return out{}, nil
	})

	// A named function as the body.
	_, _ = agenttools.New(agenttools.Def{Name: "named"}, namedBody)
}

func localHelper() error { // want localHelper:`sideEffect\(HTTP call net/http.Get\)`
	_, err := http.Get("https://x.example")
	return err
}

func namedBody(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, _ in) (out, error) { // want namedBody:`sideEffect`
	_ = helper.Notify("https://hooks.example") // want `helper.Notify → HTTP call`
	return out{}, nil
}

// Opted in by directive: not a agenttools.New body, checked all the same.
//
//ferry:tool
func directive() { // want directive:`sideEffect`
	_, _ = http.Post("https://x.example", "", nil) // want `HTTP call net/http.Post`
}
