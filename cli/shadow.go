package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/adoption/shadow"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

func shadowReportFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o ShadowReport
	fs.DurationVar(&o.Since, "since", 168*time.Hour, "how far back to compare")
	fs.StringVar(&o.Topic, "topic", "", "only this topic")
	fs.BoolVar(&o.JSON, "json", false, "print JSON")
	return func(ctx context.Context, _ []string) error {
		if o.Since <= 0 {
			return usagef("--since must be positive")
		}
		cfg, pool, err := openMigrated(ctx, "shadow")
		if err != nil {
			return err
		}
		defer pool.Close()
		o.ShadowTopics, o.OutboxTable = cfg.Relay.ShadowTopics, cfg.Relay.Table
		return o.Run(ctx, pool, env.Stdout)
	}
}

// ShadowReport is `shadow report`: shadow intents against legacy effects,
// per topic. Run fails with exit status 1 while they disagree.
type ShadowReport struct {
	Since        time.Duration
	Topic        string
	ShadowTopics []string
	OutboxTable  pgoutbox.Table
	JSON         bool
}

// Run compares and prints; a mismatch is an ExitError with code 1.
func (o ShadowReport) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if o.Since <= 0 {
		return usagef("--since must be positive")
	}
	rep, err := shadow.Report(ctx, pool, shadow.Options{Since: o.Since, Topic: o.Topic, ShadowTopics: o.ShadowTopics, OutboxTable: o.OutboxTable})
	if err != nil {
		return err
	}
	if o.JSON {
		err = WriteJSON(w, map[string]any{"since": rep.Since, "topics": rep.Topics, "agree": rep.Agree()})
	} else {
		err = printShadow(w, rep)
	}
	if err != nil {
		return err
	}
	if !rep.Agree() {
		return ExitError{Code: 1, Err: errors.New("the intents and the legacy effects do not agree: do not switch over yet")}
	}
	return nil
}

func printShadow(w io.Writer, rep shadow.ReportResult) error {
	fmt.Fprintf(w, "shadow report since %s\n", rep.Since.Format(time.RFC3339))
	if len(rep.Topics) == 0 {
		fmt.Fprintln(w, "(no shadow intents and no legacy effects in the window)")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TOPIC\tINTENTS\tLEGACY\tMATCHED\tMISSING IN OUTBOX\tMISSING IN LEGACY\tVERDICT")
	for _, t := range rep.Topics {
		verdict := "agree"
		if !t.Agree() {
			verdict = "MISMATCH"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\n", cell(t.Topic, maxIDCell), t.Intents, t.LegacyEffects, t.Matched,
			t.MissingInOutboxCount, t.MissingInLegacyCount, verdict)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, t := range rep.Topics {
		if len(t.MissingInOutbox) > 0 {
			fmt.Fprintf(w, "%s: legacy effect, no intent (sample): %s\n", cell(t.Topic, maxIDCell), sample(t.MissingInOutbox))
		}
		if len(t.MissingInLegacy) > 0 {
			fmt.Fprintf(w, "%s: intent, no legacy effect (sample): %s\n", cell(t.Topic, maxIDCell), sample(t.MissingInLegacy))
		}
	}
	return nil
}

func sample(ids []string) string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = cell(id, maxIDCell)
	}
	return strings.Join(out, ", ")
}
