"""Drives sluice's gateway with Anthropic's official Python SDK (the `anthropic` package,
unmodified), as a tool given the gateway as its base URL would.

Usage: python anthropic_client.py '<json settings>'
Settings: base_url, api_key, model (answers "Hello world!"), mid_error (a model whose stream
fails after its first token), stall (a model whose stream stops after its first token),
tools_model (a model that calls every tool it is offered). Prints one JSON object: each
scenario's findings, or the error it raised, so the Rust test asserts on them.
"""
import json
import sys

import anthropic


def raised(e):
    return {"raised": type(e).__name__, "status": getattr(e, "status_code", None),
            "body": getattr(e, "body", None), "message": str(e)}


def blocks(content):
    out = []
    for b in content:
        if b.type == "text":
            out.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            out.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
        else:
            out.append({"type": b.type})
    return out


def message(m):
    return {"id": m.id, "type": m.type, "role": m.role, "model": m.model,
            "content": blocks(m.content), "stop_reason": m.stop_reason,
            "stop_sequence": m.stop_sequence,
            "usage": {"input_tokens": m.usage.input_tokens,
                      "output_tokens": m.usage.output_tokens}}


TOOLS = [{"name": "get_weather", "description": "the weather in a city",
          "input_schema": {"type": "object", "properties": {"q": {"type": "string"}},
                           "required": ["q"]}},
         {"name": "get_time", "input_schema": {"type": "object",
                                               "properties": {"q": {"type": "string"}}}}]


def run(s):
    client = anthropic.Anthropic(base_url=s["base_url"], api_key=s["api_key"], max_retries=0,
                                 timeout=60)
    model = s["model"]
    hello = [{"role": "user", "content": "say hello"}]
    out = {"sdk_version": anthropic.__version__}

    r = client.messages.create(model=model, max_tokens=40, system="be brief", messages=hello,
                               temperature=0.3, stop_sequences=["END"],
                               metadata={"user_id": "u-1"})
    out["whole"] = {**message(r), "request_id": r._request_id}

    with client.messages.stream(model=model, max_tokens=40, messages=hello) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    out["stream"] = {"texts": texts, "final": message(final)}

    events = [e.type for e in client.messages.create(model=model, max_tokens=40,
                                                      messages=hello, stream=True)]
    out["events"] = events

    asked = [{"role": "user", "content": "weather in Paris?"}]
    r = client.messages.create(model=s["tools_model"], max_tokens=100, messages=asked,
                               tools=TOOLS)
    out["tools_whole"] = message(r)
    with client.messages.stream(model=s["tools_model"], max_tokens=100, messages=asked,
                                tools=TOOLS, tool_choice={"type": "auto"}) as stream:
        partials = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    out["tools_stream"] = {"final": message(final), "partials": partials}
    # The SDK's own blocks sent back, with each call's result.
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": answer}
               for b, answer in zip([b for b in r.content if b.type == "tool_use"],
                                    ["sunny", "noon"])]
    back = asked + [{"role": "assistant", "content": r.content},
                    {"role": "user", "content": results}]
    r = client.messages.create(model=s["tools_model"], max_tokens=100, messages=back,
                               tools=TOOLS)
    out["tools_results"] = message(r)

    bad = anthropic.Anthropic(base_url=s["base_url"], api_key="not-the-key", max_retries=0)
    cases = [
        ("refused_key", lambda: bad.messages.create(model=model, max_tokens=5, messages=hello)),
        ("refused_key_stream", lambda: list(bad.messages.create(
            model=model, max_tokens=5, messages=hello, stream=True))),
        ("not_found", lambda: client.messages.create(model="no-such-model", max_tokens=5,
                                                      messages=hello)),
        ("no_max_tokens", lambda: client.post("/v1/messages", cast_to=object, body={
            "model": model, "messages": hello})),
        ("bad_role", lambda: client.messages.create(model=model, max_tokens=5, messages=[
            {"role": "system", "content": "x"}])),
        ("refused_field", lambda: client.messages.create(model=model, max_tokens=5,
                                                          messages=hello,
                                                          extra_body={"top_k": 5})),
        ("not_object", lambda: client.post("/v1/messages", cast_to=object, body="a prompt",
                                         options={"headers": {"content-type": "application/json"}})),
    ]
    for name, call in cases:
        try:
            call()
            out[name] = {"raised": None}
        except anthropic.APIStatusError as e:
            out[name] = raised(e)

    out["models"] = sorted(m.id for m in client.models.list())
    out["model"] = client.models.retrieve(model).id

    got = []
    try:
        with client.messages.stream(model=s["mid_error"], max_tokens=40,
                                    messages=hello) as stream:
            for t in stream.text_stream:
                got.append(t)
        out["mid_error"] = {"raised": None, "texts": got}
    except anthropic.APIStatusError as e:
        out["mid_error"] = {**raised(e), "texts": got}

    # A client that stops reading and closes the stream: the provider call must end.
    stream = client.messages.create(model=s["stall"], max_tokens=40, messages=hello,
                                    stream=True)
    first = None
    for e in stream:
        if e.type == "content_block_delta":
            first = e.delta.text
            break
    stream.close()
    out["cancel"] = {"first": first}
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1])), default=str))
