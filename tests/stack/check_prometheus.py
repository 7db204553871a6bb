"""Checks a running Prometheus of the compose stack (scripts/test-stack.sh), through its HTTP API.

    python3 tests/stack/check_prometheus.py targets URL JOB...    every job has targets, all up
    python3 tests/stack/check_prometheus.py rules URL ALERTS.yml  every alert of the file loaded, healthy
    python3 tests/stack/check_prometheus.py panels URL DASHBOARD.json [--totals]
                                         every expression of every panel returns data; with
                                         --totals, evaluated on the counters themselves, a
                                         value that traffic made (not only series at 0)
    python3 tests/stack/check_prometheus.py query URL PROMQL      prints the result vector as JSON

`targets` and `panels` retry for up to --wait seconds (scrapes run every 15 s), then print
what is missing and exit 1. Standard library only.
"""

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request


def api(base, path, **params):
    url = base.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body}")
    return body["data"]


def query(base, expr):
    return api(base, "/api/v1/query", query=expr)["result"]


def check_targets(base, jobs):
    targets = api(base, "/api/v1/targets", state="active")["activeTargets"]
    problems = []
    for job in jobs:
        mine = [t for t in targets if t["labels"].get("job") == job]
        if not mine:
            problems.append(f"{job}: no target")
        for t in mine:
            if t["health"] != "up":
                problems.append(f"{job} {t['labels'].get('instance')}: {t['health']} {t.get('lastError', '')}")
    return problems, {job: len([t for t in targets if t["labels"].get("job") == job]) for job in jobs}


def alert_names(path):
    # `- alert: Name` lines: the file is YAML, but this shape is all that is needed here.
    names = re.findall(r"^\s*-\s*alert:\s*(\S+)\s*$", open(path).read(), re.M)
    if not names:
        raise SystemExit(f"{path}: no `- alert:` lines")
    return names


def check_rules(base, path):
    wanted = alert_names(path)
    loaded = {}
    for group in api(base, "/api/v1/rules")["groups"]:
        for rule in group["rules"]:
            if rule.get("type") == "alerting":
                loaded[rule["name"]] = rule
    problems = []
    for name in wanted:
        rule = loaded.get(name)
        if rule is None:
            problems.append(f"{name}: not loaded")
        elif rule.get("health") != "ok":
            problems.append(f"{name}: health {rule.get('health')} {rule.get('lastError', '')}")
    extra = sorted(set(loaded) - set(wanted))
    if extra:
        problems.append(f"loaded but not in {path}: {extra}")
    return problems, len(wanted)


def panel_exprs(path):
    """(panel title, expression) for every target of every panel, rows' panels included."""
    dashboard = json.load(open(path))

    def walk(panels):
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    out = []
    for panel in walk(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", "?"), target["expr"]))
    return out


# Expressions that are 0 when the traffic is over, or that count what the stack test does not
# cause: for these a series must exist (the metric is exported and scraped), but its value may
# be 0. Every other expression must show a non-zero value that the test's own traffic made: a
# counter registered at 0 with no traffic is not data. (A pattern found in the expression, why
# 0 is right.)
ZERO_AT_REST = [
    (r"sluice_processor_in_flight_requests\{", "a gauge of now: 0 once the test's requests ended"),
    (r"sluice_llm_in_flight_requests\{", "a gauge of now: 0 once the test's requests ended"),
    (r"sluice_gateway_open_streams\{", "a gauge of now: 0 once the test's streams closed"),
    (r"pulsar_subscription_back_log\{", "0 while the processors keep up, as they do here"),
    (r"sluice_client_unroutable_records_total\{", "records no caller waits for: not caused here"),
    (r"sluice_prompt_template_reloads_total\{", "the stack test changes no template"),
    (r"sluice_processor_redelivered_requests_total\{",
     "Pulsar does not count a redelivery after a consumer's death (apache/pulsar#18239)"),
    (r'outcome="retried"', "a publish that failed: the stack test breaks no publish"),
]


def zero_allowed(expr):
    return [why for pattern, why in ZERO_AT_REST if re.search(pattern, expr)]


def grafana_to_promql(expr, totals=False):
    # What Grafana substitutes before it sends the query: the dashboard's variables at
    # "All" (their allValue, `.*`) and $__rate_interval at its value for a 15 s scrape
    # interval (four scrape intervals: 1m).
    expr = expr.replace("$__rate_interval", "1m")
    if totals:
        # The counters and histograms behind each rate: a rate cannot show traffic that ended
        # more than its window ago, nor a series whose first sample already held the traffic
        # (a labelled counter appears at its first increment). The totals show both.
        expr = re.sub(r"\b(?:rate|irate|increase|deriv)\(([^\[\]]+)\[[^\]]+\]\)", r"(\1)", expr)
    expr = re.sub(r"\$\{?(job|processor)\}?", ".*", expr)
    if "$" in expr:
        raise SystemExit(f"unhandled Grafana variable in {expr}")
    return expr


def has_traffic(result):
    """Some series has a finite, non-zero value (NaN is a quantile of no traffic)."""
    for series in result:
        try:
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if value == value and value not in (0.0, float("inf"), float("-inf")):
            return True
    return False


def check_panels(base, path, totals=False):
    problems = []
    shown = 0
    for title, expr in panel_exprs(path):
        result = query(base, grafana_to_promql(expr, totals))
        zero_ok = zero_allowed(expr)
        if not result:
            problems.append(f"{title}: no data for {expr}")
        elif totals and not zero_ok and not has_traffic(result):
            values = [s.get("value", [None, None])[1] for s in result][:6]
            problems.append(f"{title}: only zero or NaN ({values}) for {expr}: no traffic counted")
        else:
            shown += 1
    return problems, shown


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["targets", "rules", "panels", "query"])
    parser.add_argument("url")
    parser.add_argument("args", nargs="+")
    parser.add_argument("--wait", type=float, default=90)
    parser.add_argument("--totals", action="store_true",
                        help="panels: on the counters behind the rates, require values traffic made")
    a = parser.parse_args()
    if a.what == "query":
        print(json.dumps(query(a.url, a.args[0])))
        return
    deadline = time.monotonic() + a.wait
    while True:
        if a.what == "targets":
            problems, counts = check_targets(a.url, a.args)
            summary = "targets up: " + ", ".join(f"{j} x{n}" for j, n in counts.items())
        elif a.what == "rules":
            problems, n = check_rules(a.url, a.args[0])
            summary = f"{n} alerting rules of {a.args[0]} loaded, all healthy"
        else:
            problems, n = check_panels(a.url, a.args[0], a.totals)
            summary = (f"{n} panel expressions of {a.args[0]} return data" + (
                f", on their counters values the traffic made ({len(ZERO_AT_REST)} kinds may be 0"
                " at rest)" if a.totals else ""))
        if not problems:
            print(summary)
            return
        if time.monotonic() > deadline:
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            sys.exit(f"{a.what}: {len(problems)} problem(s)")
        time.sleep(5)


if __name__ == "__main__":
    main()
