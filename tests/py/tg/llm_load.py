"""Streaming text-completion load through TrustGraph's own request/response client.

The client is trustgraph-base 2.11.1's, unmodified (the venv of scripts/tg-flow-venv.sh):
AsyncPulsarBackend (pulsar-client's asyncio API, receiver queue 1,000 by default) and
RequestResponseClient, as TrustGraph's prompt service, agent and api-gateway use them to
call text-completion. One client, one response subscription, many concurrent streams: the
way a TrustGraph service calls its LLM under load.

Each request's records are checked: the text, put together, must be exactly the fake
model's answer (`tokens-N-...`: "t0 t1 ... t{N-1} "), the output-token deltas must add up to
N, and the stream must end (`end_of_stream`) before a gap of --idle-timeout seconds, as
TrustGraph's client times out on a record that never comes.

Prints one JSON object: counts, records per request, the records per second taken between the
first record and the last, time to the first record (p50/p99), and this process's CPU seconds
(the consumer's cost of the records).

    python llm_load.py --pulsar-url pulsar://127.0.0.1:6650 --requests 1024 \
        --concurrency 512 --tokens 50
"""

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time

from trustgraph.base.async_pulsar_backend import AsyncPulsarBackend
from trustgraph.base.request_response_client import RequestResponseClient
from trustgraph.schema import TextCompletionRequest, TextCompletionResponse


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pulsar-url", required=True)
    p.add_argument("--request-topic", default="request:tg:text-completion")
    p.add_argument("--response-topic", default="response:tg:text-completion")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=512)
    p.add_argument("--tokens", type=int, default=50, help="N of the fake's tokens-N model")
    p.add_argument("--idle-timeout", type=float, default=30.0)
    a = p.parse_args()

    expected = "".join(f"t{i} " for i in range(a.tokens))
    backend = AsyncPulsarBackend(host=a.pulsar_url)
    client = await RequestResponseClient.create(
        backend=backend,
        request_topic=a.request_topic,
        response_topic=a.response_topic,
        request_schema=TextCompletionRequest,
        response_schema=TextCompletionResponse,
        default_timeout=a.idle_timeout,
    )
    # create() returns once the broker has attached the response subscription (pulsar-client's
    # subscribe completes on the broker's answer): records sent from here on reach it.

    stats = {
        "complete": 0, "timed_out": 0, "errors": 0, "wrong_text": 0,
        "wrong_tokens": 0, "records": 0,
    }
    first = []
    examples = []
    # When the consumer handed over its first and its last record: the records per second
    # between them are what it took (on a persistent topic, where the broker holds back what
    # it has no permits for, that is its capacity on this machine now).
    span = {"first": None, "last": None}
    todo = iter(range(a.requests))

    async def one(i):
        text, out_tokens, records, t0 = [], 0, 0, time.monotonic()
        try:
            async for resp in client.request_stream(
                TextCompletionRequest(system="", prompt=f"request {i}", streaming=True),
                timeout=a.idle_timeout,
            ):
                now = time.monotonic()
                if records == 0:
                    first.append(now - t0)
                if span["first"] is None:
                    span["first"] = now
                span["last"] = now
                records += 1
                if resp.error:
                    stats["errors"] += 1
                    if len(examples) < 5:
                        examples.append(f"request {i}: error {resp.error.message}")
                    break
                text.append(resp.response or "")
                out_tokens += resp.out_token or 0
                if resp.end_of_stream:
                    whole = "".join(text)
                    if whole != expected:
                        stats["wrong_text"] += 1
                        if len(examples) < 5:
                            examples.append(f"request {i}: text {whole[:80]!r}")
                    elif out_tokens != a.tokens:
                        stats["wrong_tokens"] += 1
                    else:
                        stats["complete"] += 1
                    break
        except asyncio.TimeoutError:
            stats["timed_out"] += 1
            if len(examples) < 5:
                examples.append(f"request {i}: no record for {a.idle_timeout} s after {records}")
        stats["records"] += records

    async def worker():
        for i in todo:
            await one(i)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    wall = time.monotonic() - started
    await client.close()
    await backend.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = dict(stats)
    out.update({
        "requests": a.requests,
        "concurrency": a.concurrency,
        "records_per_request": round(stats["records"] / max(1, a.requests), 2),
        "first_record_p50_ms": round(1000 * (percentile(first, 0.5) or 0), 1),
        "first_record_p99_ms": round(1000 * (percentile(first, 0.99) or 0), 1),
        "first_record_mean_ms": round(1000 * statistics.fmean(first), 1) if first else None,
        "wall_seconds": round(wall, 2),
        "records_per_second": (
            round(stats["records"] / (span["last"] - span["first"]), 1)
            if span["first"] is not None and span["last"] > span["first"] else None
        ),
        "consumer_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
        "examples": examples,
    })
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.stderr.flush()
    # pulsar-client's C++ side can abort while the interpreter tears down ("terminate called
    # without an active exception"): the report is out, so leave without the teardown.
    os._exit(0)
