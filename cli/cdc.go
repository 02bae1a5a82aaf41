package cli

import (
	"context"
	"flag"
	"fmt"

	"github.com/ferry-dev/ferry/pipeline/pgcdc"
)

func cdcDropFlags(fs *flag.FlagSet, env *Env) RunFunc {
	slot := fs.String("slot", "", "slot name (default: FERRY_CDC_SLOT, or ferry_<database>_<schema>)")
	publication := fs.String("publication", "", "publication name (default: FERRY_CDC_PUBLICATION, or the slot's name)")
	return func(ctx context.Context, _ []string) error {
		cfg, pool, err := openConfigured(ctx, "cdc")
		if err != nil {
			return err
		}
		defer pool.Close()
		c := cfg.CDC
		if *slot != "" {
			c.Slot = *slot
		}
		if *publication != "" {
			c.Publication = *publication
		}
		for name, v := range map[string]string{"--slot": c.Slot, "--publication": c.Publication} {
			if v != "" {
				if err := pgcdc.ValidateName(v); err != nil {
					return usagef("%s %v", name, err)
				}
			}
		}
		s, p, err := pgcdc.Names(ctx, pool, c)
		if err != nil {
			return err
		}
		droppedSlot, droppedPub, err := pgcdc.Drop(ctx, pool, s, p)
		if err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "replication slot %s: %s\npublication %s: %s\n", s, droppedWord(droppedSlot), p, droppedWord(droppedPub))
		return nil
	}
}

func droppedWord(dropped bool) string {
	if dropped {
		return "dropped"
	}
	return "not there"
}
