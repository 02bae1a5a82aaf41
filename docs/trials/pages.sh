#!/usr/bin/env bash
# The on-call trial of deploy/prometheus/alerts.yml, live: the orders
# example as three processes (serve, relay, consume) under 6 orders/s, a
# real Prometheus (Debian's; scraping every 5 s, the rules unchanged) and
# Alertmanager (deploy/alertmanager/alertmanager.yml with webhook
# receivers that record each notification), through three incidents:
#
#   +2m   the payment provider down for 15 minutes
#   +21m  the consumer fleet dead for 6 minutes
#   +31m  payments.charge paused for 10 minutes
#   +46m  end
#
# It prints each notification (receiver, status, alerts) with its delay
# from its incident's start, and checks the orders: each charged once.
# Run it by hand on a machine with PostgreSQL and RabbitMQ (as CI's);
# it uses its own schema and vhost and removes them. Not part of CI: it
# takes 46 minutes. docs/trials/pages.md holds a run's results.
#
#   bash docs/trials/pages.sh [minutes-scale]   (1 = the timings above)
set -euo pipefail
cd "$(dirname "$0")/../.."
scale=${1:-1}
work=$(mktemp -d /tmp/ferry-pages.XXXX)
run=$(date +%s)
log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$work/timeline.log"; }
mins() { awk -v m="$1" -v s="$scale" 'BEGIN { printf "%d", m * 60 * s }'; }

schema=ferry_trial_pages
vhost=ferry_trial_pages
export FERRY_DATABASE_URL="postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
export FERRY_DATABASE_SCHEMA=$schema
export FERRY_AMQP_URL="amqp://guest:guest@127.0.0.1:5672/$vhost"
export FERRY_PAYMENT_URL="http://127.0.0.1:12111"
export FERRY_SMTP_ADDR="127.0.0.1:2525"
export FERRY_LOG_LEVEL=warn
rabbitmqctl -q add_vhost "$vhost" >/dev/null
rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null

go build -o "$work/ferry" ./cmd/ferry
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PGOPTIONS='-c client_min_messages=warning' psql -h 127.0.0.1 -U postgres -d test -qc "DROP SCHEMA IF EXISTS $schema CASCADE" || true
  rabbitmqctl -q delete_vhost "$vhost" >/dev/null || true
  echo "kept: $work"
}
trap cleanup EXIT

# The notifications, as Alertmanager sends them: one JSON line each.
cat > "$work/receiver.py" <<'EOF'
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
out = open(sys.argv[2], "a", buffering=1)
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        alerts = [(a["labels"].get("alertname"), a["labels"].get("handler", a["labels"].get("component", "")), a["status"]) for a in body["alerts"]]
        out.write(json.dumps({"at": time.time(), "receiver": self.path.strip("/"), "status": body["status"], "alerts": alerts}) + "\n")
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
EOF
python3 "$work/receiver.py" 19099 "$work/notifications.jsonl" & pids+=($!)

sed -e 's#^  - name: on-call$#  - name: on-call\n    webhook_configs: [{url: "http://127.0.0.1:19099/on-call", send_resolved: true}]#' \
    -e 's#^  - name: tickets$#  - name: tickets\n    webhook_configs: [{url: "http://127.0.0.1:19099/tickets", send_resolved: true}]#' \
    deploy/alertmanager/alertmanager.yml > "$work/alertmanager.yml"
prometheus-alertmanager --config.file="$work/alertmanager.yml" --storage.path="$work/am" \
  --web.listen-address=127.0.0.1:19093 --cluster.listen-address= >"$work/alertmanager.log" 2>&1 & pids+=($!)

cp deploy/prometheus/alerts.yml "$work/alerts.yml"
cat > "$work/prometheus.yml" <<EOF
global: {scrape_interval: 5s, evaluation_interval: 30s}
alerting: {alertmanagers: [{static_configs: [{targets: ["127.0.0.1:19093"]}]}]}
rule_files: ["$work/alerts.yml"]
scrape_configs:
  - job_name: ferry
    static_configs: [{targets: ["127.0.0.1:19191", "127.0.0.1:19192", "127.0.0.1:19193"]}]
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/prom" \
  --web.listen-address=127.0.0.1:19090 >"$work/prometheus.log" 2>&1 & pids+=($!)

# The outside world: payments and SMTP in two processes, so that the
# provider can go down alone.
"$work/ferry" sandbox --payments-addr 127.0.0.1:12111 --smtp-addr 127.0.0.1:12526 >"$work/payments.log" 2>&1 & payments=$!; pids+=($payments)
"$work/ferry" sandbox --payments-addr 127.0.0.1:12112 --smtp-addr 127.0.0.1:2525 >"$work/smtp.log" 2>&1 & pids+=($!)

"$work/ferry" migrate up >/dev/null
# Every process must be up: a trial without traffic proves nothing (a
# configuration error ends it here, with the process's own words).
alive() { sleep 3; kill -0 "$1" 2>/dev/null || { echo "$2 exited at start:"; cat "$3"; exit 1; }; }
start_consumers() {
  FERRY_ADMIN_ADDR=127.0.0.1:19193 "$work/ferry" consume >>"$work/consume.log" 2>&1 & consume=$!; pids+=($consume)
}
FERRY_ADMIN_ADDR=127.0.0.1:19191 FERRY_ADMIN_TOKEN=trial-console-token-16plus FERRY_HTTP_ADDR=127.0.0.1:18080 "$work/ferry" serve >"$work/serve.log" 2>&1 & serve=$!; pids+=($serve)
FERRY_ADMIN_ADDR=127.0.0.1:19192 "$work/ferry" relay >"$work/relay.log" 2>&1 & relay=$!; pids+=($relay)
start_consumers
alive "$serve" serve "$work/serve.log"; alive "$relay" relay "$work/relay.log"; alive "$consume" consume "$work/consume.log"
sleep 5

# 6 orders/s, each its own user (so its own aggregate).
(
  i=0
  while true; do
    i=$((i + 1))
    curl -s -o /dev/null -X POST -H "Content-Type: application/json" -H "Idempotency-Key: trial-$run-$i" \
      -d "{\"user_id\":\"u$i\",\"amount\":$((100 + i % 900)),\"currency\":\"USD\"}" http://127.0.0.1:18080/orders &
    sleep 0.166
  done
) & load=$!; pids+=($load)

# What status, /metrics and the console say of the holds and the pause,
# at one moment.
sample() {
  date +%s > "$work/at-$1"
  "$work/ferry" status --json > "$work/status-$1.json" 2>/dev/null || true
  curl -s http://127.0.0.1:19193/metrics | grep -E '^ferry_(partition_held_seconds|handler_paused_seconds)' > "$work/metrics-$1.txt" || true
  local auth="Authorization: Bearer trial-console-token-16plus"
  curl -s -H "$auth" http://127.0.0.1:19191/console/handlers > "$work/console-handlers-$1.html" || true
  for c in $(python3 -c 'import json, sys; print(" ".join(p["consumer"] for p in (json.load(open(sys.argv[1])).get("held_partitions") or [])))' "$work/status-$1.json" 2>/dev/null); do
    curl -s -H "$auth" "http://127.0.0.1:19191/console/held/$c" > "$work/console-held-$1-$c.html" || true
  done
}

t0=$(date +%s)
at() { local until=$((t0 + $(mins "$1"))); while [ "$(date +%s)" -lt "$until" ]; do sleep 1; done; }
log "start (t0)"
at 2;  log "incident 1: provider down";  kill "$payments"; wait "$payments" 2>/dev/null || true
at 12; sample held
at 17; log "incident 1: provider back"
"$work/ferry" sandbox --payments-addr 127.0.0.1:12111 --smtp-addr 127.0.0.1:12526 >>"$work/payments.log" 2>&1 & payments=$!; pids+=($payments)
at 21; log "incident 2: consumer fleet killed"; kill -9 "$consume"; wait "$consume" 2>/dev/null || true
at 27; log "incident 2: consumer fleet back"; start_consumers
at 31; log "incident 3: pause";  "$work/ferry" pause --reason "provider maintenance" payments.charge >/dev/null
at 36; sample paused
at 41; log "incident 3: resume"; "$work/ferry" resume payments.charge >/dev/null
at 46; log "end"
kill "$load"; sleep 20

log "notifications (seconds from t0):"
python3 - "$work/notifications.jsonl" "$t0" <<'EOF' | tee -a "$work/timeline.log"
import json, sys
t0 = float(sys.argv[2])
for line in open(sys.argv[1]):
    n = json.loads(line)
    m, s = divmod(int(n["at"] - t0), 60)
    print(f"+{m}m{s:02d}s  {n['receiver']:8} {n['status']:9} {n['alerts']}")
EOF
# When each alert fired and resolved in Prometheus, beside when Ferry's own
# state says each cause ended (the holds, the queues without consumers,
# the pause): "resolves within 2 minutes after" is read off these.
log "firing in Prometheus, and the causes as Ferry's metrics show them (from t0):"
python3 - "$t0" "$(date +%s)" <<'EOF' | tee -a "$work/timeline.log"
import json, sys, urllib.parse, urllib.request
t0, end = float(sys.argv[1]), sys.argv[2]
def spans(query):
    q = urllib.parse.urlencode({"query": query, "start": int(t0), "end": end, "step": 5})
    res = json.load(urllib.request.urlopen("http://127.0.0.1:19090/api/v1/query_range?" + q))["data"]["result"]
    for r in res:
        ts = [float(t) for t, _ in r["values"]]
        start = prev = ts[0]
        for t in ts[1:]:
            if t - prev > 5:
                yield r["metric"], start, prev
                start = t
            prev = t
        yield r["metric"], start, prev
def fmt(t):
    m, s = divmod(int(t - t0), 60)
    return f"+{m}m{s:02d}s"
for metric, a, b in spans('ALERTS{alertstate="firing"}'):
    who = metric.get("handler") or metric.get("component") or ""
    print(f"alert {metric['alertname']:30} {who:18} {fmt(a)} .. {fmt(b)}")
for name, query in (("held", "max(ferry_partition_held_seconds) > 0"),
                    ("no consumer", "count(max by (queue) (ferry_queue_consumers) == 0) > 0"),
                    ("paused", "max(ferry_handler_paused_seconds) > 0")):
    for _, a, b in spans(query):
        print(f"cause {name:30} {'':18} {fmt(a)} .. {fmt(b)}")
EOF
"$work/ferry" status --json > "$work/status.json" || true
log "hold and pause: ferry status --json, /metrics and the console (seconds)"
python3 - "$work" <<'EOF' | tee -a "$work/timeline.log"
import html, json, os, re, sys
from datetime import datetime
w = sys.argv[1]
def ts(s): return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", s.replace("Z", "+00:00"))).timestamp()
for label, key, field, metric, lab in (("held", "held_partitions", "since", "ferry_partition_held_seconds", "consumer"),
                                       ("paused", "paused_handlers", "paused_at", "ferry_handler_paused_seconds", "handler")):
    at = float(open(f"{w}/at-{label}").read())
    status = json.load(open(f"{w}/status-{label}.json")).get(key) or []
    metrics = {}
    for line in open(f"{w}/metrics-{label}.txt"):
        m = re.match(r'(\w+)\{(.*)\} (\S+)', line)
        if m and m.group(1) == metric:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            metrics[labels[lab]] = float(m.group(3))
    handlers_html = open(f"{w}/console-handlers-{label}.html").read() if os.path.exists(f"{w}/console-handlers-{label}.html") else ""
    for s in status:
        name = s.get("consumer") or s.get("handler")
        console = float("nan")
        if label == "held" and os.path.exists(f"{w}/console-held-{label}-{name}.html"):
            m = re.search(r'id="held-since" datetime="([^"]+)"', open(f"{w}/console-held-{label}-{name}.html").read())
            console = at - ts(m.group(1)) if m else console
        elif label == "paused":
            row = re.search(re.escape(html.escape(name)) + r'.*?class="paused-since" datetime="([^"]+)"', handlers_html, re.S)
            console = at - ts(row.group(1)) if row else console
        print(f"{label:6} {name:22} status {at - ts(s[field]):7.0f}  metrics {metrics.get(name, float('nan')):7.0f}  console {console:7.0f}")
EOF
orders=$(psql -h 127.0.0.1 -U postgres -d test -Atc "SELECT count(*) FROM $schema.orders")
charges=$(grep -c '^charge ' "$work/payments.log" || true)
distinct=$( (grep -o 'OrderID:[^ ]*' "$work/payments.log" || true) | sort -u | wc -l)
log "orders $orders, charges $charges, orders charged $distinct"
