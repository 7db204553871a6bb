"""Drives sluice's gateway with Ollama's official Python client (the `ollama` package,
unmodified), as a tool given the gateway as its Ollama host would.

Usage: python ollama_client.py '<json settings>'
Settings: host, api_key, model (answers "Hello world!"), mid_error (a model whose stream fails
after its first token), stall (a model whose stream stops after its first token), tools_model
(a model that calls every tool it is offered). Prints one JSON object: each scenario's
findings, or the error it raised, so the Rust test asserts on them.
"""
import json
import sys

import ollama


def raised(e):
    return {"raised": type(e).__name__, "status": getattr(e, "status_code", None),
            "error": getattr(e, "error", str(e))}


def run(s):
    auth = {"Authorization": "Bearer " + s["api_key"]}
    client = ollama.Client(host=s["host"], headers=auth, timeout=60)
    model = s["model"]
    hello = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "say hello"}]
    out = {}

    r = client.chat(model=model, messages=hello, stream=False,
                    options={"temperature": 0.3, "num_ctx": 4096, "num_predict": 40})
    out["chat_whole"] = {"content": r.message.content, "role": r.message.role, "done": r.done,
                         "done_reason": r.done_reason, "model": r.model,
                         "prompt_eval_count": r.prompt_eval_count, "eval_count": r.eval_count,
                         "total_duration": r.total_duration,
                         "created_at": r.created_at}

    parts = list(client.chat(model=model, messages=hello, stream=True))
    out["chat_stream"] = {"content": "".join(p.message.content or "" for p in parts),
                          "lines": len(parts), "done": [p.done for p in parts],
                          "done_reason": parts[-1].done_reason,
                          "eval_count": parts[-1].eval_count,
                          "prompt_eval_count": parts[-1].prompt_eval_count}

    r = client.generate(model=model, prompt="say hello", system="be brief")
    out["generate_whole"] = {"response": r.response, "done": r.done, "done_reason": r.done_reason,
                             "eval_count": r.eval_count}

    parts = list(client.generate(model=model, prompt="say hello", stream=True))
    out["generate_stream"] = {"response": "".join(p.response for p in parts),
                              "lines": len(parts), "done": parts[-1].done,
                              "eval_count": parts[-1].eval_count}

    r = client.chat(model=model, messages=[{"role": "user", "content": "a JSON object"}],
                    format={"type": "object", "properties": {"a": {"type": "string"}}})
    out["structured"] = {"content": r.message.content}

    bad = ollama.Client(host=s["host"], headers={"Authorization": "Bearer not-the-key"})
    for name, call in [("refused_key", lambda: bad.chat(model=model, messages=hello)),
                       ("refused_key_stream", lambda: list(bad.chat(model=model, messages=hello,
                                                                    stream=True))),
                       ("not_found", lambda: client.chat(model="no-such-model", messages=hello)),
                       ("refused_option", lambda: client.generate(model=model, prompt="x",
                                                                  options={"seed": 7}))]:
        try:
            call()
            out[name] = {"raised": None}
        except ollama.ResponseError as e:
            out[name] = raised(e)

    got = []
    try:
        for p in client.chat(model=s["mid_error"], messages=hello, stream=True):
            got.append(p.message.content)
        out["mid_error"] = {"raised": None, "content": "".join(got)}
    except ollama.ResponseError as e:
        out["mid_error"] = {**raised(e), "content": "".join(got)}

    # A client that stops reading and closes the stream: the provider call must end.
    stream = client.chat(model=s["stall"], messages=hello, stream=True)
    first = next(stream)
    stream.close()
    out["cancel"] = {"first": first.message.content}

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                       "required": ["q"]}}}]
    asked = [{"role": "user", "content": "weather in Paris?"}]
    for name, stream in [("tools_whole", False), ("tools_stream", True)]:
        if stream:
            calls = [c for p in client.chat(model=s["tools_model"], messages=asked, tools=tools,
                                            stream=True)
                     for c in (p.message.tool_calls or [])]
        else:
            calls = client.chat(model=s["tools_model"], messages=asked,
                                tools=tools).message.tool_calls or []
        out[name] = [{"name": c.function.name, "arguments": dict(c.function.arguments)}
                     for c in calls]
    call = client.chat(model=s["tools_model"], messages=asked, tools=tools).message
    results = asked + [call, {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    out["tools_results"] = {
        "content": client.chat(model=s["tools_model"], messages=results, tools=tools).message.content}

    out["list"] = sorted(m.model for m in client.list().models)
    out["show"] = client.show(model).capabilities
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1])), default=str))
