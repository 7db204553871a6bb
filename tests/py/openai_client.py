"""Drives sluice's gateway with OpenAI's official Python SDK (the `openai` package, unmodified).

Usage: python openai_client.py '<json settings>'
Settings: base_url, api_key, model (answers normally), and optionally mid_error (a model whose
stream fails after its first token), gated (a model whose stream waits after its first token)
and only (a list of the scenarios to run). Prints one JSON object: each scenario's findings, or
the exception it raised, so the Rust test asserts on them.
"""
import json
import sys

import openai


def run(settings):
    client = openai.OpenAI(base_url=settings["base_url"], api_key=settings["api_key"],
                           max_retries=0, timeout=60)
    model = settings["model"]
    only = settings.get("only")
    out = {"sdk_version": openai.__version__}

    def scenario(name):
        return only is None or name in only

    if scenario("whole"):
        r = client.chat.completions.create(model=model, messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "say hello"}])
        out["whole"] = {"id": r.id, "object": r.object, "model": r.model,
                        "content": r.choices[0].message.content,
                        "role": r.choices[0].message.role,
                        "finish_reason": r.choices[0].finish_reason,
                        "usage": r.usage.model_dump() if r.usage else None}

    if scenario("stream"):
        chunks = list(client.chat.completions.create(
            model=model, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "say hello"}]))
        out["stream"] = {
            "chunks": len(chunks),
            "content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            "first_role": chunks[0].choices[0].delta.role if chunks and chunks[0].choices else None,
            "finish_reason": next((c.choices[0].finish_reason for c in chunks
                                   if c.choices and c.choices[0].finish_reason), None),
            "usage": chunks[-1].usage.model_dump() if chunks and chunks[-1].usage else None,
            "ids": sorted({c.id for c in chunks}),
        }

    if scenario("multi_turn"):
        r = client.chat.completions.create(
            model=model, temperature=0.3, max_tokens=40, stop=["\n\n"],
            messages=[{"role": "system", "content": "answer in one word"},
                      {"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "Paris"},
                      {"role": "user", "content": "And of Italy?"}])
        out["multi_turn"] = {"content": r.choices[0].message.content,
                             "finish_reason": r.choices[0].finish_reason}

    if scenario("not_found"):
        try:
            client.chat.completions.create(model="no-such-model",
                                           messages=[{"role": "user", "content": "hi"}])
            out["not_found"] = {"raised": None}
        except openai.APIStatusError as e:
            out["not_found"] = {"raised": type(e).__name__, "status": e.status_code,
                                "code": e.code, "param": e.param, "type": e.type}

    if scenario("refused"):
        try:
            client.chat.completions.create(model=model, n=3,
                                           messages=[{"role": "user", "content": "hi"}])
            out["refused"] = {"raised": None}
        except openai.APIStatusError as e:
            out["refused"] = {"raised": type(e).__name__, "status": e.status_code,
                              "code": e.code, "param": e.param}

    if scenario("mid_error") and settings.get("mid_error"):
        got = []
        try:
            for c in client.chat.completions.create(
                    model=settings["mid_error"], stream=True,
                    messages=[{"role": "user", "content": "hi"}]):
                got.extend(ch.delta.content or "" for ch in c.choices)
            out["mid_error"] = {"raised": None, "content": "".join(got)}
        except openai.APIError as e:
            out["mid_error"] = {"raised": type(e).__name__, "message": e.message,
                                "content": "".join(got)}

    if scenario("cancel") and settings.get("gated"):
        stream = client.chat.completions.create(
            model=settings["gated"], stream=True,
            messages=[{"role": "user", "content": "hi"}])
        first = ""
        for c in stream:
            first += "".join(ch.delta.content or "" for ch in c.choices)
            if first:
                break
        stream.close()
        out["cancel"] = {"first": first, "closed": True}

    if scenario("models"):
        out["models"] = sorted(m.id for m in client.models.list())

    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
