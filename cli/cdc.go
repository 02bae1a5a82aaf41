package cli

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline/pgcdc"
)

func cdcDropFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o CDCDrop
	fs.StringVar(&o.Slot, "slot", "", "slot name (default: FERRY_CDC_SLOT, or ferry_<database>_<schema>)")
	fs.StringVar(&o.Publication, "publication", "", "publication name (default: FERRY_CDC_PUBLICATION, or the slot's name)")
	return func(ctx context.Context, _ []string) error {
		if err := o.validate(); err != nil {
			return err
		}
		cfg, pool, err := openConfigured(ctx, "cdc")
		if err != nil {
			return err
		}
		defer pool.Close()
		o.Config = cfg.CDC
		return o.Run(ctx, pool, env.Stdout)
	}
}

// CDCDrop is `cdc drop`: removes the CDC relay's replication slot and
// publication (Slot and Publication, else Config's, else the defaults).
type CDCDrop struct {
	Slot, Publication string
	Config            pgcdc.Config
}

func (o CDCDrop) validate() error {
	for name, v := range map[string]string{"--slot": o.Slot, "--publication": o.Publication} {
		if v != "" {
			if err := pgcdc.ValidateName(v); err != nil {
				return usagef("%s %v", name, err)
			}
		}
	}
	return nil
}

// Run drops what exists and says what it dropped.
func (o CDCDrop) Run(ctx context.Context, pool *pgxpool.Pool, w io.Writer) error {
	if err := o.validate(); err != nil {
		return err
	}
	c := o.Config
	if o.Slot != "" {
		c.Slot = o.Slot
	}
	if o.Publication != "" {
		c.Publication = o.Publication
	}
	s, p, err := pgcdc.Names(ctx, pool, c)
	if err != nil {
		return err
	}
	droppedSlot, droppedPub, err := pgcdc.Drop(ctx, pool, s, p)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "replication slot %s: %s\npublication %s: %s\n", s, droppedWord(droppedSlot), p, droppedWord(droppedPub))
	return err
}

func droppedWord(dropped bool) string {
	if dropped {
		return "dropped"
	}
	return "not there"
}
