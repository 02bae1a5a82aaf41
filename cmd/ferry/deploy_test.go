package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/metrics"
)

type composeFile struct {
	FerryEnv map[string]string `yaml:"x-ferry-env"`
	Services map[string]struct {
		Image       string            `yaml:"image"`
		Build       any               `yaml:"build"`
		Command     []string          `yaml:"command"`
		Environment map[string]string `yaml:"environment"`
		Ports       []string          `yaml:"ports"`
		Volumes     []string          `yaml:"volumes"`
		Healthcheck *struct {
			Test []string `yaml:"test"`
		} `yaml:"healthcheck"`
		DependsOn map[string]struct {
			Condition string `yaml:"condition"`
		} `yaml:"depends_on"`
	} `yaml:"services"`
	Volumes map[string]any `yaml:"volumes"`
}

// docker compose cannot run here; this keeps docker-compose.yml in step
// with what the binary reads and serves.
func TestDockerComposeMatchesTheBinary(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../docker-compose.yml")
	require.NoError(t, err)
	var c composeFile
	require.NoError(t, yaml.Unmarshal(raw, &c))

	known := map[string]bool{}
	for _, ev := range append(app.EnvVars(), options().EnvVars...) {
		known[ev.Name] = true
	}
	for k := range c.FerryEnv {
		require.True(t, known[k], "docker-compose.yml sets %s, which ferry does not read", k)
	}
	env := map[string]string{}
	for k, v := range c.FerryEnv {
		env[k] = regexp.MustCompile(`\$\{[A-Z_]+:-([^}]*)\}`).ReplaceAllString(v, "$1")
	}
	cfg, err := app.ConfigFromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err, "the compose environment must be a valid configuration")

	for _, name := range []string{"postgres", "rabbitmq", "ferry", "migrate", "prometheus", "grafana"} {
		require.Contains(t, c.Services, name)
	}
	for _, name := range []string{"postgres", "rabbitmq", "ferry", "prometheus", "grafana"} {
		require.NotNil(t, c.Services[name].Healthcheck, "%s needs a healthcheck", name)
	}
	ferry := c.Services["ferry"]
	require.Equal(t, []string{"run"}, ferry.Command)
	require.Equal(t, []string{"migrate", "up"}, c.Services["migrate"].Command)
	require.Equal(t, "service_completed_successfully", ferry.DependsOn["migrate"].Condition, "ferry waits for its schema")
	require.Equal(t, "service_healthy", ferry.DependsOn["rabbitmq"].Condition, "ferry waits for its broker")
	require.Equal(t, "service_healthy", c.Services["migrate"].DependsOn["postgres"].Condition)
	require.Equal(t, "healthcheck", ferry.Healthcheck.Test[2])
	adminPort := cfg.AdminAddr[strings.LastIndex(cfg.AdminAddr, ":")+1:]
	require.Contains(t, ferry.Ports, "127.0.0.1:"+adminPort+":"+adminPort)
	require.Contains(t, ferry.Healthcheck.Test, "http://127.0.0.1:"+adminPort+"/readyz")

	prom, err := os.ReadFile("../../deploy/prometheus/prometheus.yml")
	require.NoError(t, err)
	require.Contains(t, string(prom), `"ferry:`+adminPort+`"`, "Prometheus scrapes the admin port")

	// The image is built once and every Ferry service runs it; no port
	// that a local server would hold is published; no known admin token.
	builds := 0
	for _, name := range []string{"migrate", "ferry", "sandbox"} {
		s := c.Services[name]
		require.Equal(t, "ferry:local", s.Image, "%s runs the one Ferry image", name)
		if s.Build != nil {
			builds++
		}
	}
	require.Equal(t, 1, builds, "the Ferry image is built by one service")
	for name, s := range c.Services {
		for _, p := range s.Ports {
			for _, clash := range []string{":5432:", ":5672:", ":15672:", ":6379:", ":9090:", ":3306:", ":1883:", ":4222:"} {
				require.NotContains(t, ":"+p, clash, "%s publishes a port a local server would hold: %s", name, p)
			}
		}
	}
	require.Empty(t, cfg.AdminToken, "compose ships no admin token: the user sets one")
	require.NotContains(t, string(raw), "change-me")

	for name, s := range c.Services {
		for _, v := range s.Volumes {
			src, _, _ := strings.Cut(v, ":")
			if strings.HasPrefix(src, "./") {
				_, err := os.Stat(filepath.Join("..", "..", src))
				require.NoError(t, err, "%s mounts %s, which must exist", name, src)
			} else {
				require.Contains(t, c.Volumes, src, "%s uses the named volume %s, which must be declared", name, src)
			}
		}
	}
}

// The dashboard is valid JSON and charts only metrics Ferry exports.
func TestGrafanaDashboardUsesFerrysMetrics(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../deploy/grafana/dashboards/ferry.json")
	require.NoError(t, err)
	var dash struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct {
				Name string `json:"name"`
				Type string `json:"type"`
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			Title      string `json:"title"`
			Datasource struct {
				UID string `json:"uid"`
			} `json:"datasource"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dash))
	require.NotEmpty(t, dash.UID)
	vars := map[string]string{}
	for _, v := range dash.Templating.List {
		vars[v.Name] = v.Type
	}
	require.Equal(t, map[string]string{"datasource": "datasource", "instance": "query", "topic": "query"}, vars,
		"a data source variable (no hard-coded uid), and instance and topic variables")
	for _, p := range dash.Panels {
		require.Equal(t, "${datasource}", p.Datasource.UID, p.Title)
		for _, tg := range p.Targets {
			// Every process reports the same store-wide gauges: a sum
			// across instances counts them once per process.
			for _, gauge := range []string{"ferry_poison_messages", "outbox_pending", "ferry_retrying_messages", "outbox_oldest_pending"} {
				require.False(t, strings.Contains(tg.Expr, gauge) && strings.Contains(tg.Expr, "sum"), "%s: %s is the same in every process: max, never sum", p.Title, gauge)
			}
		}
	}
	// What the binary exports: Ferry's own metrics, and the one Watermill
	// router metric the dashboard charts (components/metrics).
	exported := append(metrics.New().Names(), "handler_execution_time_seconds_bucket")
	metric := regexp.MustCompile(`\b(outbox_[a-z_0-9]+|ferry_[a-z_0-9]+|handler_execution_[a-z_]+)\b`)
	charted := map[string]bool{}
	for _, p := range dash.Panels {
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			for _, m := range metric.FindAllString(tg.Expr, -1) {
				require.True(t, slices.Contains(exported, m), "panel %q charts %s, which Ferry does not export", p.Title, m)
				charted[m] = true
			}
		}
	}
	for _, must := range []string{"outbox_pending_total", "outbox_dispatch_latency_seconds_bucket", "outbox_attempts_bucket", "outbox_dispatched_total", "ferry_poison_messages", "ferry_retrying_messages"} {
		require.True(t, charted[must], "the dashboard must chart %s", must)
	}
}

// Every paging alert can be acted on: the dashboard charts each metric its
// rule reads, and its runbook link points at a runbook in
// docs/operations.md.
func TestEveryPagingAlertHasAPanelAndARunbook(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &rules))
	dash, err := os.ReadFile("../../deploy/grafana/dashboards/ferry.json")
	require.NoError(t, err)
	ops, err := os.ReadFile("../../docs/operations.md")
	require.NoError(t, err)
	metric := regexp.MustCompile(`\b(outbox_[a-z_0-9]+|ferry_[a-z_0-9]+)\b`)
	paging := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			anchor := "#runbook-" + strings.ToLower(r.Alert)
			require.True(t, strings.HasSuffix(r.Annotations["runbook"], "docs/operations.md"+anchor), "%s: runbook link %q", r.Alert, r.Annotations["runbook"])
			require.Contains(t, string(ops), "### Runbook: "+r.Alert+"\n", "%s has no runbook", r.Alert)
			if r.Labels["severity"] != "page" {
				continue
			}
			paging++
			for _, m := range metric.FindAllString(r.Expr, -1) {
				require.Contains(t, string(dash), m, "%s pages on %s, which no dashboard panel charts", r.Alert, m)
			}
		}
	}
	require.GreaterOrEqual(t, paging, 8)
}

// The image listens on every interface of its container (its loopback is
// unreachable through EXPOSE), and its build context leaves out what the
// build does not need.
func TestDockerImageListensBeyondItsLoopback(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../Dockerfile")
	require.NoError(t, err)
	for _, want := range []string{"FERRY_HTTP_ADDR=0.0.0.0:8080", "FERRY_ADMIN_ADDR=0.0.0.0:9091", "EXPOSE 8080 9091", "USER nonroot"} {
		require.Contains(t, string(raw), want)
	}
	ignore, err := os.ReadFile("../../.dockerignore")
	require.NoError(t, err)
	for _, want := range []string{".git", "bin"} {
		require.Contains(t, strings.Fields(string(ignore)), want)
	}
}
