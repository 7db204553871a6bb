"""Drives sluice's gateway with OpenAI's official Python SDK (the `openai` package, unmodified).

Usage: python openai_client.py '<json settings>'
Settings: base_url, api_key, model (answers normally), and optionally mid_error (a model whose
stream fails after its first token), gated (a model whose stream waits after its first token),
tools_model (a model that calls every tool it is offered), structured_model (a model asked
for a Pydantic response_format) and only (a list of the scenarios to
run). Prints one JSON object: each scenario's findings, or
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

    if scenario("tools") and settings.get("tools_model"):
        tools_scenarios(client, settings["tools_model"], out)
    if scenario("structured") and settings.get("structured_model"):
        structured_scenarios(client, settings["structured_model"], out)

    if scenario("models"):
        out["models"] = sorted(m.id for m in client.models.list())

    return out


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                       "required": ["q"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]


def tools_scenarios(client, model, out):
    """Tool calls whole, sent back, streamed through the SDK's helper, raw, and parsed."""
    asked = [{"role": "user", "content": "Paris"}]
    r = client.chat.completions.create(model=model, messages=asked, tools=TOOLS)
    m = r.choices[0].message
    calls = [[c.function.name, c.function.arguments] for c in m.tool_calls or []]
    # The SDK's own message object goes back as the assistant turn, then one result per call.
    answered = asked + [m.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": c.function.name + " ok"}
        for c in m.tool_calls or []]
    r2 = client.chat.completions.create(model=model, messages=answered, tools=TOOLS)
    out["tools_whole"] = {"calls": calls, "content": m.content,
                          "finish_reason": r.choices[0].finish_reason,
                          "answer": r2.choices[0].message.content}

    # The streaming helper: it accumulates the pieces into calls by index.
    stream_helper = getattr(client.chat.completions, "stream", None) \
        or client.beta.chat.completions.stream
    with stream_helper(model=model, messages=asked, tools=TOOLS) as stream:
        deltas = sum(1 for e in stream if e.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion()
    fm = final.choices[0].message
    out["tools_stream"] = {
        "calls": [[c.function.name, c.function.arguments] for c in fm.tool_calls or []],
        "finish_reason": final.choices[0].finish_reason, "argument_deltas": deltas}

    # The raw stream: each call's first piece has its index, id, type and name.
    firsts = []
    for chunk in client.chat.completions.create(model=model, messages=asked, tools=TOOLS,
                                                stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                if tc.id:
                    firsts.append([tc.index, tc.type, tc.function.name])
    out["tools_raw"] = {"first_pieces": firsts}

    # `parse` with a Pydantic tool: the arguments come back as the model.
    from pydantic import BaseModel

    class Lookup(BaseModel):
        q: str

    parse = getattr(client.chat.completions, "parse", None) \
        or client.beta.chat.completions.parse
    p = parse(model=model, messages=asked, tools=[openai.pydantic_function_tool(Lookup)])
    out["tools_parse"] = {
        "parsed": p.choices[0].message.tool_calls[0].function.parsed_arguments.q}


def structured_scenarios(client, model, out):
    """`parse` and the stream helper with a Pydantic response_format: the answer comes back as
    the model, whole and streamed."""
    from typing import Literal

    from pydantic import BaseModel

    class Sky(BaseModel):
        label: Literal["blue", "grey"]

    asked = [{"role": "user", "content": "the sky"}]
    parse = getattr(client.chat.completions, "parse", None) \
        or client.beta.chat.completions.parse
    p = parse(model=model, messages=asked, response_format=Sky)
    stream_helper = getattr(client.chat.completions, "stream", None) \
        or client.beta.chat.completions.stream
    with stream_helper(model=model, messages=asked, response_format=Sky) as stream:
        final = stream.get_final_completion()
    out["structured"] = {"parsed": p.choices[0].message.parsed.label,
                         "streamed": final.choices[0].message.parsed.label,
                         "usage": p.usage.total_tokens}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
