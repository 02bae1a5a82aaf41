package ferry_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The shipped Alertmanager configuration makes one incident one
// notification: a route's outage fires FerryPartitionHeld and
// FerryHandlerFailing (inhibited by the first) in one group, a second
// cause on the same route (poison) notifies again, and the fleet's alerts
// (no handler) are one notification of their own. The file is sent
// through a real Alertmanager (Debian's prometheus-alertmanager, which
// .ci/run installs), with its waits shortened and its receivers pointed
// at this test.
func TestAlertmanagerGroupsAnIncident(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an Alertmanager; skipped with -short")
	}
	bin, err := exec.LookPath("prometheus-alertmanager")
	if err != nil {
		if bin, err = exec.LookPath("alertmanager"); err != nil {
			t.Fatal("no Alertmanager binary (prometheus-alertmanager or alertmanager) on PATH: apt-get install prometheus-alertmanager (.ci/run does)")
		}
	}
	var mu sync.Mutex
	var notes []notification
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var n notification
		if err := json.NewDecoder(r.Body).Decode(&n); err == nil {
			mu.Lock()
			notes = append(notes, n)
			mu.Unlock()
		}
	}))
	defer hook.Close()

	shipped, err := os.ReadFile("deploy/alertmanager/alertmanager.yml")
	require.NoError(t, err)
	cfg := string(shipped)
	// The waits shortened for the test; grouping and inhibition as shipped.
	for from, to := range map[string]string{"group_wait: 1m": "group_wait: 2s", "group_wait: 30s": "group_wait: 2s", "group_interval: 1m": "group_interval: 4s"} {
		require.Contains(t, cfg, from)
		cfg = strings.ReplaceAll(cfg, from, to)
	}
	for _, r := range []string{"on-call", "tickets"} {
		line := "  - name: " + r + "\n"
		require.Contains(t, cfg, line)
		cfg = strings.Replace(cfg, line, line+"    webhook_configs:\n      - url: "+hook.URL+"/"+r+"\n        send_resolved: false\n", 1)
	}
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "alertmanager.yml")
	require.NoError(t, os.WriteFile(cfgFile, []byte(cfg), 0o600))
	addr := freeLoopbackAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs bytes.Buffer
	am := exec.CommandContext(ctx, bin, "--config.file="+cfgFile, "--storage.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--cluster.listen-address=")
	am.Stdout, am.Stderr = &logs, &logs
	require.NoError(t, am.Start())
	defer func() { cancel(); _ = am.Wait() }()
	base := "http://" + addr
	require.Eventually(t, func() bool {
		resp, err := http.Get(base + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 100*time.Millisecond, "Alertmanager did not start: %s", &logs)

	// The alerts start now: one older than the group wait is sent at once,
	// without waiting for the rest of its group.
	started := time.Now()
	post := func(alerts ...map[string]string) {
		t.Helper()
		var body []map[string]any
		for _, labels := range alerts {
			body = append(body, map[string]any{"labels": labels, "startsAt": started.Format(time.RFC3339Nano)})
		}
		b, err := json.Marshal(body)
		require.NoError(t, err)
		resp, err := http.Post(base+"/api/v2/alerts", "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, string(msg))
	}
	page := func(name, handler string) map[string]string {
		l := map[string]string{"alertname": name, "severity": "page"}
		if handler != "" {
			l["handler"] = handler
		}
		return l
	}
	sent := func() []notification {
		mu.Lock()
		defer mu.Unlock()
		return append([]notification(nil), notes...)
	}
	// The route's outage, and the fleet's trouble, at once (Prometheus
	// re-sends firing alerts, as it does every evaluation).
	// (The inhibiting alert first: Alertmanager's inhibitor follows the
	// alerts it is sent a moment behind, and a group of the test's 2 s
	// wait could go out before it saw a source that came in the same
	// request; Prometheus's 30 s group wait leaves it time.)
	post(page("FerryPartitionHeld", "ledger.post"), page("FerryQueueWithoutConsumer", ""))
	time.Sleep(300 * time.Millisecond)
	for range 3 {
		post(page("FerryPartitionHeld", "ledger.post"), page("FerryHandlerFailing", "ledger.post"),
			page("FerryQueueWithoutConsumer", ""), page("FerryNoLiveRelay", ""))
		time.Sleep(500 * time.Millisecond)
	}
	require.Eventually(t, func() bool { return len(sent()) >= 2 }, 20*time.Second, 100*time.Millisecond, "two incidents, two notifications: %s", &logs)
	time.Sleep(5 * time.Second) // a group_interval: nothing new, nothing sent
	got := sent()
	require.Len(t, got, 2, "one notification per incident: %+v", got)
	byGroup := map[string]notification{}
	for _, n := range got {
		byGroup[n.GroupLabels["handler"]] = n
	}
	require.Equal(t, []string{"FerryPartitionHeld"}, byGroup["ledger.post"].names(), "the held partitions' alert inhibits the failing one")
	require.ElementsMatch(t, []string{"FerryQueueWithoutConsumer", "FerryNoLiveRelay"}, byGroup[""].names())

	// A second cause on the route (a permanent refusal; the outage's own
	// give-ups do not fire: FerryPoisonArriving leaves them to the alert
	// already firing) notifies again.
	poison := func(cause string) map[string]string {
		l := page("FerryPoisonArriving", "ledger.post")
		l["cause"] = cause
		return l
	}
	post(page("FerryPartitionHeld", "ledger.post"), page("FerryHandlerFailing", "ledger.post"), poison("account # is closed"))
	require.Eventually(t, func() bool { return len(sent()) == 3 }, 20*time.Second, 100*time.Millisecond, "the new cause was not sent: %s", &logs)
	require.ElementsMatch(t, []string{"FerryPartitionHeld", "FerryPoisonArriving"}, sent()[2].names())
	for _, a := range sent()[2].Alerts {
		if a.Labels["alertname"] == "FerryPoisonArriving" {
			require.Equal(t, "account # is closed", a.Labels["cause"])
		}
	}
}

// notification is what Alertmanager's webhook receiver is sent.
type notification struct {
	Receiver    string            `json:"receiver"`
	GroupLabels map[string]string `json:"groupLabels"`
	Alerts      []struct {
		Labels map[string]string `json:"labels"`
	} `json:"alerts"`
}

func (n notification) names() []string {
	var out []string
	for _, a := range n.Alerts {
		out = append(out, a.Labels["alertname"])
	}
	return out
}

func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return fmt.Sprint(l.Addr())
}
