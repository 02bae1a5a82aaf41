package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ferry-dev/ferry/internal/display"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// DefaultActionLimit caps a requeue or discard unless --limit says
// otherwise: a mistyped --all does not resend a whole store at once.
const DefaultActionLimit = 1000

func poisonFlags(sub string) func(*flag.FlagSet, *Env) RunFunc {
	return func(fs *flag.FlagSet, env *Env) RunFunc {
		var (
			sel         pgpoison.Selector
			ids, filter string
			asJSON, dry bool
			group       bool
		)
		fs.BoolVar(&asJSON, "json", false, "print JSON (exact, unescaped and uncut)")
		fs.StringVar(&filter, "filter", "", "narrow by handler=H,aggregate=A,text=T,fingerprint=F,correlation=C,message=M,tenant=ID,since=24h|RFC3339,until=… (comma-separated; as the console's filters)")
		fs.Int64Var(&sel.AfterID, "after-id", 0, "start after this poison id (the next page)")
		if sub == "list" {
			fs.StringVar(&sel.Topic, "topic", "", "only this original topic")
			fs.IntVar(&sel.Limit, "limit", 50, fmt.Sprintf("at most this many, oldest first (0: all, streamed; at most %d)", pgpoison.MaxLimit))
			fs.BoolVar(&group, "group", false, "group by error fingerprint (the reason with ids, numbers and addresses normalised away): count, first and last seen, an example")
		} else {
			fs.StringVar(&ids, "id", "", "poison ids, comma-separated")
			fs.StringVar(&sel.Topic, "topic", "", "every message of this original topic")
			fs.BoolVar(&sel.All, "all", false, "every message")
			fs.IntVar(&sel.Limit, "limit", DefaultActionLimit, fmt.Sprintf("at most this many, oldest first (0: no cap; at most %d)", pgpoison.MaxLimit))
			fs.BoolVar(&dry, "dry-run", false, "take the same steps and checks, then roll back: say what would happen, change nothing")
		}
		return func(ctx context.Context, _ []string) error {
			for _, p := range strings.Split(ids, ",") {
				if p = strings.TrimSpace(p); p == "" {
					continue
				}
				id, err := strconv.ParseInt(p, 10, 64)
				if err != nil || id <= 0 {
					return usagef("--id: %q is not a poison id", p)
				}
				sel.IDs = append(sel.IDs, id)
			}
			if filter != "" {
				f, err := ParseFilter(filter)
				if err != nil {
					return UsageError{fmt.Errorf("--filter: %w", err)}
				}
				sel.Filter = f // --topic stays Selector.Topic
			}
			// What list reads: the filter with --topic and the paging flags.
			lf := sel.Filter
			lf.Topic, lf.AfterID, lf.Limit = sel.Topic, sel.AfterID, sel.Limit
			// Refuse bad flags before connecting, let alone changing anything.
			check := sel.Validate
			if sub == "list" {
				check = lf.Validate
			}
			if err := check(); err != nil {
				return UsageError{flagNames(err)}
			}
			store, closeStore, err := openPoisonStore(ctx)
			if err != nil {
				return err
			}
			defer closeStore()
			if sub == "list" {
				return PoisonList{Filter: lf, Group: group, JSON: asJSON}.Run(ctx, store, env.Stdout)
			}
			return PoisonAction{Action: sub, Selector: sel, DryRun: dry, Actor: pgaudit.CLIActor(), JSON: asJSON}.Run(ctx, store, env.Stdout)
		}
	}
}

// PoisonList is `poison list`: the messages a filter chooses (its Topic,
// AfterID and Limit included), or their groups by fingerprint.
type PoisonList struct {
	Filter pgpoison.Filter
	Group  bool
	JSON   bool
}

// Run prints what store holds.
func (o PoisonList) Run(ctx context.Context, store *pgpoison.Store, w io.Writer) error {
	if err := o.Filter.Validate(); err != nil {
		return UsageError{flagNames(err)}
	}
	if o.Group {
		return listGroups(ctx, w, store, o.Filter, o.JSON)
	}
	return listPoison(ctx, w, store, o.Filter, o.JSON)
}

// PoisonAction is `poison requeue` and `poison discard`: the library call
// the console's buttons make (pgpoison.Store's RequeueEach and
// DiscardEach, each page audited in its own transaction), streamed.
type PoisonAction struct {
	// Action is "requeue" or "discard".
	Action   string
	Selector pgpoison.Selector
	DryRun   bool
	// Actor is who acts, for the audit log (pgaudit.CLIActor()).
	Actor string
	JSON  bool
}

// Run acts (or, dry, says what it would do), printing each message.
func (o PoisonAction) Run(ctx context.Context, store *pgpoison.Store, w io.Writer) error {
	if err := o.Selector.Validate(); err != nil {
		return UsageError{flagNames(err)}
	}
	act := store.RequeueEach
	verb, dryVerb := "requeued", "would requeue"
	switch o.Action {
	case "requeue":
	case "discard":
		act, verb, dryVerb = store.DiscardEach, "discarded", "would discard"
	default:
		return fmt.Errorf("cli: PoisonAction.Action must be requeue or discard, got %q", o.Action)
	}
	if o.DryRun {
		verb = dryVerb
	}
	return streamActions(w, o.JSON, verb, func(fn func(pgpoison.Action) error) (pgpoison.Summary, error) {
		return act(ctx, o.Selector, pgpoison.Run{DryRun: o.DryRun, Actor: o.Actor}, fn)
	})
}

// ParseFilter reads --filter: key=value pairs, comma-separated, the
// console's filter words (pgfilter.Parse).
func ParseFilter(v string) (pgpoison.Filter, error) { return pgfilter.Parse(v) }

func listGroups(ctx context.Context, w io.Writer, store *pgpoison.Store, f pgpoison.Filter, asJSON bool) error {
	f.AfterID, f.Limit = 0, 0
	groups, err := store.Groups(ctx, f, 0)
	if err != nil {
		return err
	}
	if asJSON {
		return WriteJSON(w, groups)
	}
	if len(groups) == 0 {
		fmt.Fprintln(w, "(no poisoned messages)")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tHANDLERS\tFIRST SEEN\tLAST SEEN\tFINGERPRINT\tEXAMPLE")
	for _, g := range groups {
		fmt.Fprintf(tw, "%d\t%s\t%s ago\t%s ago\t%s\t%s\n", g.Count, cell(g.Handlers, maxIDCell), time.Since(g.FirstSeen).Round(time.Second),
			time.Since(g.LastSeen).Round(time.Second), cell(g.Fingerprint, maxReasonCell), cell(g.Example, maxTextCell))
	}
	fmt.Fprintf(tw, "(act on a group: %s poison requeue --filter 'fingerprint=<FINGERPRINT>' --dry-run)\n", binaryName)
	return tw.Flush()
}

// flagNames says "--limit" and "--after-id" where the store says "limit".
func flagNames(err error) error {
	msg := strings.NewReplacer("limit must", "--limit must", "after-id must", "--after-id must").Replace(err.Error())
	return errors.New(msg)
}

func openPoisonStore(ctx context.Context) (*pgpoison.Store, func(), error) {
	cfg, pool, err := openMigrated(ctx, "poison")
	if err != nil {
		return nil, nil, err
	}
	outbox, err := pgoutbox.New(outboxConfig(cfg), nil)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	store, err := pgpoison.NewStore(pool, outbox)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return store, pool.Close, nil
}

// listPoison streams the store: a page at a time from the database, a
// record at a time to the output, whatever --limit.
func listPoison(ctx context.Context, w io.Writer, store *pgpoison.Store, f pgpoison.Filter, asJSON bool) error {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	n := 0
	if asJSON {
		bw.WriteString("[")
		err := store.Each(ctx, f, func(r pgpoison.Record) error {
			if n > 0 {
				bw.WriteString(",")
			}
			n++
			bw.WriteString("\n  ")
			return writeJSONLine(bw, r)
		})
		if n > 0 {
			bw.WriteString("\n")
		}
		bw.WriteString("]\n")
		return err
	}
	total, err := store.Count(ctx, f)
	if err != nil {
		return err
	}
	tw := poisonTable(bw)
	widths := listWidths()
	var last int64
	err = store.Each(ctx, f, func(r pgpoison.Record) error {
		n++
		last = r.ID
		poisonRow(tw, r, widths)
		if n%100 == 0 {
			return tw.Flush() // column widths per 100 rows; memory stays flat
		}
		return nil
	})
	if n == 0 {
		fmt.Fprintf(bw, "(no poisoned messages%s)\n", map[bool]string{true: " under this filter", false: ""}[f.String() != ""])
		return err
	}
	if ferr := tw.Flush(); err == nil {
		err = ferr
	}
	// The total under the filter, and how to read on: the page ends at
	// --limit, and --after-id starts the next one.
	if f.AfterID > 0 {
		fmt.Fprintf(bw, "%d shown, after id %d, of %d under the filter", n, f.AfterID, total)
	} else {
		fmt.Fprintf(bw, "%d shown of %d under the filter", n, total)
	}
	if f.Limit > 0 && n == f.Limit {
		fmt.Fprintf(bw, "; next page: the same command with --after-id %d", last)
	}
	fmt.Fprintln(bw)
	return err
}

// cellWidths are the widths a poison table's cells are cut to.
type cellWidths struct{ id, reason int }

// listWidths fits the table to the terminal when COLUMNS says how wide it
// is (shells set it): the id columns shrink to an eighth of it, the reason
// takes what is left; without it, the defaults.
func listWidths() cellWidths {
	w := cellWidths{id: maxIDCell, reason: maxReasonCell}
	cols, err := strconv.Atoi(os.Getenv("COLUMNS"))
	if err != nil || cols <= 0 {
		return w
	}
	w.id = min(max(cols/8, 8), maxIDCell)
	w.reason = min(max(cols-3*w.id-60, 20), maxReasonCell)
	return w
}

// streamActions prints each requeued or discarded message as it is done,
// then the summary; it fails (exit 1) when ids were not found or messages
// were skipped, saying which.
func streamActions(w io.Writer, asJSON bool, verb string, run func(func(pgpoison.Action) error) (pgpoison.Summary, error)) error {
	bw := bufio.NewWriter(w)
	defer bw.Flush()
	n := 0
	var sum pgpoison.Summary
	var err error
	if asJSON {
		bw.WriteString(`{"actions": [`)
		sum, err = run(func(a pgpoison.Action) error {
			if n > 0 {
				bw.WriteString(",")
			}
			n++
			bw.WriteString("\n  ")
			return writeJSONLine(bw, a)
		})
		if err != nil {
			return err
		}
		bw.WriteString("\n], \"summary\": ")
		if err := writeJSONLine(bw, sum); err != nil {
			return err
		}
		bw.WriteString("}\n")
	} else {
		tw := poisonTable(bw)
		var skipped []pgpoison.Action
		sum, err = run(func(a pgpoison.Action) error {
			if !a.Done {
				skipped = append(skipped, a)
				return nil
			}
			n++
			poisonRow(tw, a.Record, listWidths())
			if n%100 == 0 {
				return tw.Flush()
			}
			return nil
		})
		if ferr := tw.Flush(); err == nil {
			err = ferr
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(bw, "%s %d message(s)\n", verb, sum.Done)
		for _, a := range skipped {
			fmt.Fprintf(bw, "skipped poison id %d: %s\n", a.Record.ID, cell(a.Why, 300))
		}
		if sum.LastID > 0 {
			fmt.Fprintf(bw, "last poison id looked at: %d (--after-id %d continues)\n", sum.LastID, sum.LastID)
		}
		if verb == "discarded" && sum.Done > 0 {
			fmt.Fprintf(bw, "run %s: `ferry poison undo --run %s` puts these back (until the archive's retention, FERRY_POISON_ARCHIVE_RETENTION)\n", sum.Run, sum.Run)
		}
	}
	var problems []string
	if len(sum.NotFound) > 0 {
		problems = append(problems, fmt.Sprintf("no poisoned message with id %s", joinIDs(sum.NotFound)))
	}
	if sum.Skipped > 0 {
		problems = append(problems, fmt.Sprintf("%d message(s) skipped", sum.Skipped))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

func writeJSONLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

func poisonTable(w io.Writer) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTOPIC\tHANDLER\tMESSAGE\tATTEMPTS\tFIRST FAILED\tPOISONED\tREASON")
	return tw
}

func poisonRow(tw io.Writer, r pgpoison.Record, w cellWidths) {
	fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s ago\t%s ago\t%s\n", r.ID, cell(r.Topic, w.id), cell(r.Handler, w.id),
		cell(r.MessageID, w.id), r.Attempts, display.Age(time.Since(r.FirstFailedAt)), display.Age(time.Since(r.PoisonedAt)),
		cell(r.Reason, w.reason))
}

func poisonUndoFlags(fs *flag.FlagSet, env *Env) RunFunc {
	run := fs.String("run", "", "the discard's run id (printed by discard, in its audit entries, on the console's result)")
	asJSON := fs.Bool("json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if *run == "" {
			return usagef("--run: name the discard to undo")
		}
		store, closeStore, err := openPoisonStore(ctx)
		if err != nil {
			return err
		}
		defer closeStore()
		return PoisonUndo{RunID: *run, Actor: pgaudit.CLIActor(), JSON: *asJSON}.Run(ctx, store, env.Stdout)
	}
}

// PoisonUndo is `poison undo`: the library call the console's Undo makes
// (pgpoison.Store.Undo).
type PoisonUndo struct {
	RunID string
	Actor string
	JSON  bool
}

// Run puts the run's discarded messages back and says which.
func (o PoisonUndo) Run(ctx context.Context, store *pgpoison.Store, w io.Writer) error {
	res, err := store.Undo(ctx, o.RunID, o.Actor)
	if err != nil {
		return err
	}
	if o.JSON {
		return WriteJSON(w, res)
	}
	_, err = fmt.Fprintf(w, "put back %d message(s) into the poison store: ids %s\n", len(res.Restored), joinIDs(res.Restored))
	return err
}

func poisonShowFlags(fs *flag.FlagSet, env *Env) RunFunc {
	asJSON := fs.Bool("json", false, "print JSON (exact)")
	return func(ctx context.Context, args []string) error {
		if len(args) != 1 {
			return usagef("want one poison id")
		}
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || id <= 0 {
			return usagef("%q is not a poison id", args[0])
		}
		store, closeStore, err := openPoisonStore(ctx)
		if err != nil {
			return err
		}
		defer closeStore()
		r, err := store.Get(ctx, id)
		if err != nil {
			return err
		}
		if *asJSON {
			return WriteJSON(env.Stdout, r)
		}
		printPoisonRecord(env.Stdout, r)
		return nil
	}
}

// printPoisonRecord shows one message whole: nothing cut but the attempt
// errors' own limits, every control character escaped.
func printPoisonRecord(w io.Writer, r pgpoison.Record) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	field := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, escapeText(v, false)) }
	field("poison id", strconv.FormatInt(r.ID, 10))
	field("message id", r.MessageID)
	field("topic", r.Topic)
	field("handler", r.Handler+" ("+r.Consumer+")")
	field("aggregate id", r.AggregateID)
	field("correlation id", r.CorrelationID)
	field("trace id", r.Headers[pipeline.MetaTraceID])
	field("attempts", strconv.Itoa(r.Attempts))
	field("permanent", strconv.FormatBool(r.Permanent))
	field("first failed", r.FirstFailedAt.Format(time.RFC3339))
	field("last failed", r.LastFailedAt.Format(time.RFC3339))
	field("poisoned", r.PoisonedAt.Format(time.RFC3339))
	_ = tw.Flush()
	fmt.Fprintf(w, "\nreason:\n  %s\n", escapeText(r.Reason, false))
	if hist := pipeline.ErrorHistory(r.Headers); len(hist) > 0 {
		fmt.Fprintf(w, "\nattempt history (newest last):\n")
		for _, h := range hist {
			fmt.Fprintf(w, "  #%d  %s  %s\n", h.Attempt, escapeText(h.At, false), escapeText(h.Error, false))
		}
	}
	fmt.Fprintf(w, "\nheaders:\n")
	keys := make([]string, 0, len(r.Headers))
	for k := range r.Headers {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "  %s: %s\n", escapeText(k, false), escapeText(r.Headers[k], false))
	}
	fmt.Fprintf(w, "\npayload (%d bytes):\n", len(r.Payload))
	var pretty bytes.Buffer
	if json.Valid(r.Payload) && json.Indent(&pretty, r.Payload, "  ", "  ") == nil {
		fmt.Fprintf(w, "  %s\n", escapeText(pretty.String(), true))
	} else {
		fmt.Fprintf(w, "  %s\n", escapeText(string(r.Payload), false))
	}
}
