"""Concurrent streaming callers of sluice's gateway, for the Kubernetes test's changes under
load (scripts/test-k8s-run.sh): rolling updates, a pod deleted mid-stream, a drain.

    python3 tests/k8s/load.py --url http://10.96.0.10:8088 --token-file F --streams 64 \
        --control DIR

Each of --streams callers sends one request after another through the gateway's NDJSON
route until the file DIR/stop appears, then finishes the request it is in and stops. Callers
take turns over three kinds (the scripted provider, fake-openai (tests/src/bin/fake-openai.rs), makes every
answer known in advance):
  * text-completion, "[fake:slow]": 200 chunks 100 ms apart, about 20 s per answer;
  * prompt, template `knowledge-classification` (built in) for one block named after the
    request: exactly one JSON object, for that block, through the prompt processor's
    JSON-lines mode;
  * agent, a question answered at once by the scripted ReAct reply (`fake answer to ...`,
    after the thought's tokens).
A request is
  * answered: it ended with a `done` event of reason `success` and the whole expected
    answer, counted from the last `restarted` status (a request re-delivered to another
    processor starts its answer again);
  * an error: an `error` event, a `done` of another reason, an HTTP status other than 200,
    or an answer that is not the expected one;
  * lost: no final event at all (connection refused or reset, the stream cut, a timeout).
Writes DIR/streaming once every caller has had the first event of its first request (the
moment a change under load may begin), and DIR/summary.json when every caller stopped: counts per kind and outcome, restarts,
the longest silence inside a stream and before its first event, and every failure (up to
20 shown with their last events). Prints one line per failure as it happens.
"""

import argparse
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse

SLOW_TEXT = "".join(f"chunk {i:03}. " for i in range(200))


def request_for(kind, n):
    if kind == "text-completion":
        return {"system": "Be terse.", "prompt": f"[fake:slow] k8s caller {n}"}
    if kind == "prompt":
        return {"id": "knowledge-classification",
                "terms": {"blocks": [{"block_id": f"b{n}", "content": "Water boils at 100 C."}]}}
    return {"question": f"What is the answer for caller {n}?"}


def expected(kind, n, text, objects):
    if kind == "text-completion":
        return text == SLOW_TEXT
    if kind == "prompt":
        return [o.get("block_id") for o in objects] == [f"b{n}"]
    return "fake answer to" in text and f"caller {n}?" in text


def one(url, token, kind, n, timeout, on_first_event=None):
    """One request; returns (outcome, detail dict). Calls on_first_event at its first event."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps(request_for(kind, n) | {"streaming": True})
    started = time.monotonic()
    last = started
    first_gap = None
    longest = 0.0
    restarts = 0
    text = ""
    objects = []
    tail = []
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        conn.request("POST", f"/api/v1/{kind}", body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json",
            "Accept": "application/x-ndjson"})
        response = conn.getresponse()
        if response.status != 200:
            return "error", {"why": f"HTTP {response.status}: {response.read(300)!r}"}
        while True:
            line = response.readline()
            if not line:
                return "lost", {"why": "the stream ended without a final event", "tail": tail}
            now = time.monotonic()
            gap = now - last
            last = now
            if first_gap is None:
                first_gap = gap
                if on_first_event:
                    on_first_event()
            else:
                longest = max(longest, gap)
            event = json.loads(line)
            tail = (tail + [event])[-3:]
            kind_of = event.get("type")
            if kind_of == "status" and "restart" in json.dumps(event):
                restarts += 1
                text, objects = "", []
            elif kind_of == "token":
                text += event.get("content") or ""
                if isinstance(event.get("object"), dict):
                    objects.append(event["object"])
            elif kind_of == "error":
                return "error", {"why": f"error event: {event.get('message') or event}",
                                 "restarts": restarts}
            elif kind_of == "done":
                if event.get("reason") != "success":
                    return "error", {"why": f"done with reason {event.get('reason')}"}
                if not expected(kind, n, text, objects):
                    return "error", {"why": f"answer not the expected one: {text[:60]!r}...{text[-30:]!r}"}
                return "answered", {"restarts": restarts, "longest": longest,
                                    "first": first_gap, "seconds": now - started}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return "lost", {"why": f"{type(e).__name__}: {e}", "tail": tail,
                        "after": time.monotonic() - started}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--control", required=True)
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="seconds of silence before a request counts as lost")
    args = parser.parse_args()
    token = open(args.token_file).read().strip()
    kinds = ["text-completion", "text-completion", "prompt", "agent"]
    stop = os.path.join(args.control, "stop")
    lock = threading.Lock()
    results = []
    counter = [0]
    waiting = [args.streams]  # callers yet to see a first event

    def streaming():
        with lock:
            waiting[0] -= 1
            if waiting[0] == 0:
                open(os.path.join(args.control, "streaming"), "w").close()

    def caller(i):
        kind = kinds[i % len(kinds)]
        started = [False]

        def first_event():
            if not started[0]:
                started[0] = True
                streaming()

        while not os.path.exists(stop):
            with lock:
                counter[0] += 1
                n = counter[0]
            outcome, detail = one(args.url, token, kind, n, args.timeout, first_event)
            first_event()  # a first request without any event still ends the wait
            detail |= {"kind": kind, "n": n, "outcome": outcome}
            with lock:
                results.append(detail)
            if kind != "text-completion":
                time.sleep(0.25)  # the quick kinds: a caller's pause, not a busy loop
            if outcome != "answered":
                with lock:
                    failures = sum(1 for r in results if r["outcome"] != "answered")
                if failures <= 10:
                    print(f"[load] {kind} #{n}: {outcome}: {detail.get('why')}",
                          file=sys.stderr, flush=True)
                time.sleep(0.5)  # a refused connection would otherwise spin

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    print(f"[load] {args.streams} callers started", file=sys.stderr, flush=True)
    for t in threads:
        t.join()
    summary = {"requests": len(results), "by_kind": {}, "failures": [],
               "restarted": sum(1 for r in results if r.get("restarts")),
               "longest_silence_s": round(max((r.get("longest", 0) for r in results), default=0), 2),
               "longest_first_event_s": round(max((r.get("first") or 0 for r in results), default=0), 2)}
    for r in results:
        by = summary["by_kind"].setdefault(r["kind"], {"answered": 0, "error": 0, "lost": 0})
        by[r["outcome"]] += 1
    summary["answered"] = sum(1 for r in results if r["outcome"] == "answered")
    summary["errors"] = sum(1 for r in results if r["outcome"] == "error")
    summary["lost"] = sum(1 for r in results if r["outcome"] == "lost")
    summary["failures"] = [r for r in results if r["outcome"] != "answered"][:20]
    with open(os.path.join(args.control, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
