package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"
)

func healthcheckFlags(fs *flag.FlagSet, env *Env) RunFunc {
	var o Healthcheck
	fs.StringVar(&o.URL, "url", "", "URL to probe (default http://<FERRY_ADMIN_ADDR>/readyz); credentials in it are used, never printed")
	return func(ctx context.Context, _ []string) error {
		if o.URL == "" {
			cfg, err := LoadConfig()
			if err != nil {
				return err
			}
			addr := strings.Replace(cfg.AdminAddr, "0.0.0.0", "127.0.0.1", 1)
			o.URL = "http://" + addr + "/readyz"
		}
		return o.Run(ctx, env.Stdout)
	}
}

// Healthcheck is `healthcheck`: a GET of URL that must answer 200 within
// four seconds, for container healthchecks (the image has no shell or
// curl).
type Healthcheck struct {
	URL string
}

// Run probes the URL; credentials in it are used, never printed.
func (o Healthcheck) Run(ctx context.Context, w io.Writer) error {
	u, err := url.Parse(o.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return usagef("--url must be an http(s) URL")
	}
	shown := u.Redacted()
	ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return usagef("--url %s: cannot build a request", shown)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its text repeats the URL, credentials and all
		}
		return fmt.Errorf("probing %s: %w", shown, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s answered %d: %s", shown, resp.StatusCode, cell(string(body), 300))
	}
	_, err = fmt.Fprintf(w, "ok: %s\n", cell(string(body), 300))
	return err
}
