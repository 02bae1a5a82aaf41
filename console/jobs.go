package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgjobs"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// startJob runs a confirmed action over more than MaxActionRows in the
// background, in this process, and sends the browser to the job's page.
// The request returns at once: a reply lost after minutes (a proxy's
// timeout) made browsers re-send the POST and report "0 done". The job
// records its confirmation, so a re-sent form starts nothing; each page of
// the action commits with its own audit entry, so a job cut short by a
// stop leaves done exactly what its page says was done.
func (c *Console) startJob(w http.ResponseWriter, r *http.Request, act string, run pgpoison.Run, total int,
	do func(context.Context, func(pgpoison.Action) error) (pgpoison.Summary, error)) {
	id, err := pgjobs.Start(r.Context(), c.pool, "poison."+act, run.Scope, run.Actor, run.ID, run.Confirmation, total)
	if errors.Is(err, pgjobs.ErrConfirmationUsed) {
		c.fail(w, r, http.StatusConflict, err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	// The job outlives the request; its context keeps the request's values
	// (the logger's trace) but not its end.
	ctx := context.WithoutCancel(r.Context())
	go c.runJob(ctx, id, act, total, do)
	http.Redirect(w, r, c.cfg.Prefix+"/jobs/"+strconv.FormatInt(id, 10), http.StatusSeeOther)
}

func (c *Console) runJob(ctx context.Context, id int64, act string, total int, do func(context.Context, func(pgpoison.Action) error) (pgpoison.Summary, error)) {
	done, skipped := 0, 0
	last := time.Now()
	report := func() {
		if err := pgjobs.Progress(ctx, c.pool, id, done, skipped); err != nil {
			c.cfg.Logger.ErrorContext(ctx, "console: recording a job's progress", "job", id, "error", err)
		}
	}
	sum, err := do(ctx, func(a pgpoison.Action) error {
		if a.Done {
			done++
		} else {
			skipped++
		}
		// fn is told each action as its page commits: report once a page
		// (pages are 500) or once a second, whichever comes first.
		if (done+skipped)%500 == 0 || time.Since(last) > time.Second {
			report()
			last = time.Now()
		}
		return nil
	})
	state, looked := pgjobs.Done, total
	if err != nil {
		// Cut short: the rest was not looked at, not found missing.
		looked = sum.Done + sum.Skipped
	}
	result := actionResult(act, looked, sum, " (the audit log names each, with why)")
	if err != nil {
		state = pgjobs.Failed
		if errors.Is(err, pgaudit.ErrConfirmationUsed) {
			result = err.Error()
		} else {
			result += fmt.Sprintf(" before it failed: %v (what was done stays done; the rest is still in the store)", err)
		}
		c.cfg.Logger.ErrorContext(ctx, "console: a background job failed", "job", id, "action", act, "error", err)
	}
	if err := pgjobs.Finish(ctx, c.pool, id, state, sum.Done, sum.Skipped, result); err != nil {
		c.cfg.Logger.ErrorContext(ctx, "console: recording a job's end", "job", id, "error", err)
	}
}

func (c *Console) jobPage(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		c.fail(w, r, http.StatusNotFound, "no such job")
		return
	}
	job, err := pgjobs.Get(r.Context(), c.pool, id)
	if errors.Is(err, pgjobs.ErrNotFound) {
		c.fail(w, r, http.StatusNotFound, "no such job")
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	p := &jobPage{Job: job}
	if job.State == pgjobs.Done && job.Action == "poison.discard" && job.Done > 0 {
		p.Undo = job.Run
	}
	c.render(w, r, "job", p)
}

// undo puts a discard's run back (pgpoison.Store.Undo, as `ferry poison
// undo` does).
func (c *Console) undo(w http.ResponseWriter, r *http.Request) {
	run := r.PostForm.Get("run")
	if run == "" || len(run) > 64 {
		c.fail(w, r, http.StatusBadRequest, "name the discard to undo")
		return
	}
	n, err := c.store.Archived(r.Context(), run)
	if err != nil {
		c.internal(w, r, err)
		return
	}
	if n == 0 {
		c.fail(w, r, http.StatusConflict, pgpoison.ErrNothingToUndo.Error())
		return
	}
	if !c.asked(r, "undo", run) {
		c.ask(w, r, askPage{Title: "Confirm undo", Button: fmt.Sprintf("Yes, put back %d", n), Cancel: "/audit", Path: "/undo",
			Message: fmt.Sprintf("This will put back the messages that discard %s removed, under their ids, into the poison store.", run), Count: n,
			Fields: [][2]string{{"run", run}}}, "undo", run)
		return
	}
	undo := func(ctx context.Context, fn func(pgpoison.Action) error) (pgpoison.Summary, error) {
		done, err := c.store.UndoEach(ctx, run, c.actor(r), func(ids []int64) error {
			for _, id := range ids {
				if err := fn(pgpoison.Action{Record: pgpoison.Record{ID: id}, Done: true}); err != nil {
					return err
				}
			}
			return nil
		})
		return pgpoison.Summary{Done: done, Run: run}, err
	}
	if n > MaxActionRows {
		// Pages of 500, each committed with its audit entry, as a discard's.
		c.startJob(w, r, "undo", pgpoison.Run{Actor: c.actor(r), Scope: "run " + run, ID: run, Confirmation: r.PostForm.Get("confirm")}, n, undo)
		return
	}
	sum, err := undo(r.Context(), func(pgpoison.Action) error { return nil })
	if errors.Is(err, pgpoison.ErrNothingToUndo) {
		c.fail(w, r, http.StatusConflict, err.Error())
		return
	}
	if err != nil {
		c.internal(w, r, err)
		return
	}
	flash := fmt.Sprintf("put back %d message(s) into the poison store (undid discard %s)", sum.Done, run)
	c.redirectFlash(w, r, "/poison", flash, nil)
}
