// Package ferrylint is a go/analysis analyzer that keeps side effects out
// of agent tool bodies: a tool (package tools) may write its business rows
// through its transaction and reach the world only through its Emitter, as
// intents in the outbox. ferrylint reports, inside a tool body, calls that
// would act directly:
//
//   - HTTP client calls (net/http: Client.Do/Get/Post/…, http.Get/Post/…,
//     Transport.RoundTrip), net/smtp, os/exec, raw dials and listens (net);
//   - database calls outside the tool's transaction: database/sql (DB, Conn,
//     Tx, Stmt), pgxpool.Pool and pgx.Conn;
//   - publishing other than the tool's Emitter: AMQP (amqp091 Channel.Publish…),
//     any Watermill Publish(topic, ...*message.Message), and the outbox
//     publisher (pgoutbox.Outbox.PublishTx/PublishEventsTx, which bypass the
//     call record's intent ids).
//
// It follows calls into helper functions, in the same package and in
// others (through analysis facts): a body that calls a helper which calls
// http.Post is reported at the call of the helper, saying through what.
//
// A tool body is the function passed as the body to agenttools.New; any other
// function opts in with a //ferry:tool line in its doc comment. A finding
// is suppressed only by //ferry:allow-side-effect <reason> on the line of
// the call or the line above it; a suppression without a reason is itself
// reported. Calls through interfaces other than Watermill's publisher, and
// through function values, cannot be resolved statically and are not
// followed.
package ferrylint

import (
	"go/ast"
	"go/token"
	"go/types"
	"slices"
	"strings"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/types/typeutil"
)

// Analyzer is ferrylint.
var Analyzer = &analysis.Analyzer{
	Name:      "ferrylint",
	Doc:       "reports side effects (HTTP, SMTP, exec, dials, database calls outside the tool's transaction, publishing) inside agent tool bodies",
	URL:       "https://github.com/ferry-dev/ferry#ferrylint",
	Run:       run,
	FactTypes: []analysis.Fact{new(SideEffect)},
}

// SideEffect is the fact that a function performs a side effect, directly
// or through the functions it calls.
type SideEffect struct {
	// Via is the call chain to the effect, "helper.Notify → net/http.Post".
	Via string
}

func (*SideEffect) AFact() {}

func (f *SideEffect) String() string { return "sideEffect(" + f.Via + ")" }

const (
	toolsPkg      = "github.com/ferry-dev/ferry/agenttools"
	directiveTool = "//ferry:tool"
	directiveOK   = "//ferry:allow-side-effect"
)

func run(pass *analysis.Pass) (any, error) {
	allow := suppressions(pass)
	// Facts for this package's functions: a fixpoint over its call graph,
	// since a helper may call another declared later.
	decls := map[*types.Func]*ast.FuncDecl{}
	for _, f := range pass.Files {
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
				if obj, ok := pass.TypesInfo.Defs[fd.Name].(*types.Func); ok {
					decls[obj] = fd
				}
			}
		}
	}
	effects := map[*types.Func]string{}
	for changed := true; changed; {
		changed = false
		for fn, fd := range decls {
			if _, done := effects[fn]; done {
				continue
			}
			if via := firstEffect(pass, fd.Body, allow, effects, false); via != "" {
				effects[fn] = via
				changed = true
			}
		}
	}
	for fn, via := range effects {
		pass.ExportObjectFact(fn, &SideEffect{Via: via})
	}

	// Tool bodies: the body argument of agenttools.New, and //ferry:tool functions.
	for _, f := range pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncDecl:
				if n.Body != nil && hasDirective(n.Doc, directiveTool) {
					checkBody(pass, n.Body, allow, effects)
				}
			case *ast.CallExpr:
				fn, ok := typeutil.Callee(pass.TypesInfo, n).(*types.Func)
				if !ok || fn.Pkg() == nil || fn.Pkg().Path() != toolsPkg || fn.Name() != "New" || len(n.Args) < 2 {
					return true
				}
				switch body := ast.Unparen(n.Args[1]).(type) {
				case *ast.FuncLit:
					checkBody(pass, body.Body, allow, effects)
				default:
					// A named function as the body: its own declaration here,
					// or its fact from another package.
					if id := calleeIdent(body); id != nil {
						if obj, ok := pass.TypesInfo.Uses[id].(*types.Func); ok {
							if fd := decls[obj]; fd != nil {
								checkBody(pass, fd.Body, allow, effects)
							} else if via := factOf(pass, obj, effects); via != "" {
								pass.Reportf(body.Pos(), "tool body %s has a side effect (%s): a tool reaches the world only through its Emitter, as intents", obj.Name(), via)
							}
						}
					}
				}
			}
			return true
		})
	}
	return nil, nil
}

func calleeIdent(e ast.Expr) *ast.Ident {
	switch e := e.(type) {
	case *ast.Ident:
		return e
	case *ast.SelectorExpr:
		return e.Sel
	case *ast.IndexExpr:
		return calleeIdent(e.X)
	case *ast.IndexListExpr:
		return calleeIdent(e.X)
	}
	return nil
}

// checkBody reports every side effect in a tool body.
func checkBody(pass *analysis.Pass, body *ast.BlockStmt, allow map[token.Pos]string, effects map[*types.Func]string) {
	firstEffect(pass, body, allow, effects, true)
}

// firstEffect finds the side effects under n. With report it reports each
// one; without, it returns the first one's description ("" for none).
// Suppressed calls count for neither.
func firstEffect(pass *analysis.Pass, n ast.Node, allow map[token.Pos]string, effects map[*types.Func]string, report bool) string {
	found := ""
	ast.Inspect(n, func(n ast.Node) bool {
		if found != "" && !report {
			return false
		}
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		via := ""
		fn, _ := typeutil.Callee(pass.TypesInfo, call).(*types.Func)
		if fn != nil && fn.Pkg() != nil && fn.Pkg().Path() == toolsPkg {
			if recvName(fn) == "Emitter" {
				return true // the sanctioned way out: intents in the call's transaction
			}
			if fn.Name() == "New" && !report {
				// Defining a tool does not run its body: the body is
				// checked as a tool body, not charged to the definer.
				return false
			}
		}
		if fn != nil {
			if what := sink(fn); what != "" {
				via = what
			} else if f := factOf(pass, fn, effects); f != "" {
				via = qualified(fn) + " → " + f
			}
		}
		if via == "" {
			return true
		}
		if reason, suppressed := suppressedAt(pass, call.Pos(), allow); suppressed {
			if reason == "" && report {
				pass.Reportf(call.Pos(), "%s needs a reason: %s <why this side effect is safe here>", directiveOK, directiveOK)
			}
			return true
		}
		if report {
			pass.Reportf(call.Pos(), "side effect in a tool body: %s; a tool reaches the world only through its Emitter, as intents (or mark it %s <reason>)", via, directiveOK)
		} else if found == "" {
			found = via
		}
		return true
	})
	return found
}

func factOf(pass *analysis.Pass, fn *types.Func, local map[*types.Func]string) string {
	fn = fn.Origin()
	if via, ok := local[fn]; ok {
		return via
	}
	var f SideEffect
	if fn.Pkg() != nil && fn.Pkg() != pass.Pkg && pass.ImportObjectFact(fn, &f) {
		return f.Via
	}
	return ""
}

func qualified(fn *types.Func) string {
	if fn.Pkg() == nil {
		return fn.Name()
	}
	if recv := recvName(fn); recv != "" {
		return fn.Pkg().Name() + "." + recv + "." + fn.Name()
	}
	return fn.Pkg().Name() + "." + fn.Name()
}

func recvName(fn *types.Func) string {
	sig, ok := fn.Type().(*types.Signature)
	if !ok || sig.Recv() == nil {
		return ""
	}
	t := sig.Recv().Type()
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	if n, ok := t.(*types.Named); ok {
		return n.Obj().Name()
	}
	return ""
}

var (
	httpFuncs    = []string{"Get", "Post", "PostForm", "Head"}
	httpClient   = []string{"Do", "Get", "Post", "PostForm", "Head"}
	execCmd      = []string{"Run", "Start", "Output", "CombinedOutput"}
	netDials     = []string{"Dial", "DialTimeout", "DialTCP", "DialUDP", "DialIP", "DialUnix", "Listen", "ListenPacket", "ListenTCP", "ListenUDP", "ListenUnix", "ListenIP"}
	sqlMethods   = []string{"Exec", "ExecContext", "Query", "QueryContext", "QueryRow", "QueryRowContext", "Begin", "BeginTx", "Prepare", "PrepareContext", "Conn", "Commit"}
	pgxMethods   = []string{"Exec", "Query", "QueryRow", "Begin", "BeginTx", "SendBatch", "CopyFrom", "Acquire", "AcquireFunc"}
	amqpPublish  = []string{"Publish", "PublishWithContext", "PublishWithDeferredConfirm", "PublishWithDeferredConfirmWithContext"}
	outboxPublic = []string{"PublishTx", "PublishEventsTx", "Publisher"}
)

// sink names the side effect fn performs, or "" when it is not one.
func sink(fn *types.Func) string {
	if fn.Pkg() == nil {
		return ""
	}
	pkg, name, recv := fn.Pkg().Path(), fn.Name(), recvName(fn)
	what := pkg + "." + name
	if recv != "" {
		what = pkg + ".(" + recv + ")." + name
	}
	switch {
	case pkg == "net/http" && recv == "" && slices.Contains(httpFuncs, name),
		pkg == "net/http" && recv == "Client" && slices.Contains(httpClient, name),
		pkg == "net/http" && recv == "Transport" && name == "RoundTrip":
		return "HTTP call " + what
	case pkg == "net/smtp":
		return "SMTP " + what
	case pkg == "os/exec" && recv == "" && (name == "Command" || name == "CommandContext"),
		pkg == "os/exec" && recv == "Cmd" && slices.Contains(execCmd, name):
		return "process " + what
	case pkg == "net" && recv == "" && slices.Contains(netDials, name),
		pkg == "net" && recv == "Dialer" && (name == "Dial" || name == "DialContext"):
		return "network " + what
	case pkg == "database/sql" && (recv == "DB" || recv == "Conn" || recv == "Tx" || recv == "Stmt") && slices.Contains(sqlMethods, name):
		return "database call outside the tool's transaction " + what
	case pkg == "github.com/jackc/pgx/v5/pgxpool" && (recv == "Pool" || recv == "Conn") && slices.Contains(pgxMethods, name),
		pkg == "github.com/jackc/pgx/v5" && recv == "Conn" && slices.Contains(pgxMethods, name):
		return "database call outside the tool's transaction " + what
	case strings.HasPrefix(pkg, "github.com/rabbitmq/amqp091-go") && recv == "Channel" && slices.Contains(amqpPublish, name):
		return "AMQP publish " + what
	case pkg == "github.com/ferry-dev/ferry/pipeline/pgoutbox" && recv == "Outbox" && slices.Contains(outboxPublic, name):
		return "outbox publish bypassing the Emitter " + what
	case name == "Publish" && isWatermillPublish(fn):
		return "Watermill publish " + what
	}
	return ""
}

// isWatermillPublish: Publish(topic string, messages ...*message.Message) error.
func isWatermillPublish(fn *types.Func) bool {
	sig, ok := fn.Type().(*types.Signature)
	if !ok || sig.Recv() == nil || !sig.Variadic() || sig.Params().Len() != 2 {
		return false
	}
	sl, ok := sig.Params().At(1).Type().(*types.Slice)
	if !ok {
		return false
	}
	p, ok := sl.Elem().(*types.Pointer)
	if !ok {
		return false
	}
	n, ok := p.Elem().(*types.Named)
	return ok && n.Obj().Pkg() != nil && n.Obj().Pkg().Path() == "github.com/ThreeDotsLabs/watermill/message" && n.Obj().Name() == "Message"
}

func hasDirective(doc *ast.CommentGroup, d string) bool {
	if doc == nil {
		return false
	}
	for _, c := range doc.List {
		if c.Text == d || strings.HasPrefix(c.Text, d+" ") {
			return true
		}
	}
	return false
}

// suppressions maps the position of every //ferry:allow-side-effect
// comment to its reason.
func suppressions(pass *analysis.Pass) map[token.Pos]string {
	out := map[token.Pos]string{}
	for _, f := range pass.Files {
		for _, cg := range f.Comments {
			for _, c := range cg.List {
				if rest, ok := strings.CutPrefix(c.Text, directiveOK); ok && (rest == "" || rest[0] == ' ' || rest[0] == '\t') {
					out[c.Pos()] = strings.TrimSpace(rest)
				}
			}
		}
	}
	return out
}

// suppressedAt: a suppression on the call's line or the line above.
func suppressedAt(pass *analysis.Pass, pos token.Pos, allow map[token.Pos]string) (string, bool) {
	at := pass.Fset.Position(pos)
	for cpos, reason := range allow {
		c := pass.Fset.Position(cpos)
		if c.Filename == at.Filename && (c.Line == at.Line || c.Line == at.Line-1) {
			return reason, true
		}
	}
	return "", false
}
