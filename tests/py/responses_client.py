"""Drives sluice's gateway with OpenAI's official Python SDK (the `openai` package, unmodified)
through the Responses API: `client.responses.create` whole and streamed, the
`client.responses.stream` helper, function tools, structured output and the errors.

Usage: python responses_client.py '<json settings>'
Settings: base_url, api_key, model (answers "Hello world!"), and optionally mid_error (a model
whose stream fails after its first token), stall (a model whose stream stops after its first
token), tools_model (a model that calls every tool it is offered), structured_model (a model
asked for a schema) and only (the scenarios to run). Prints one JSON object: each scenario's
findings, or the exception it raised, so the Rust test asserts on them.
"""
import json
import sys
from typing import Literal

import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                          "required": ["q"], "additionalProperties": False},
           "strict": True}


def raised(e):
    body = getattr(e, "body", None)
    return {"raised": type(e).__name__, "status": getattr(e, "status_code", None),
            "code": getattr(e, "code", None), "param": getattr(e, "param", None),
            "body": body if isinstance(body, (dict, type(None))) else str(body)}


def usage(u):
    return u.model_dump() if u is not None else None


def run(s):
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0,
                           timeout=60)
    model = s.get("model")
    only = s.get("only")
    out = {}

    def scenario(name):
        return only is None or name in only

    if scenario("whole"):
        r = client.responses.create(model=model, input="say hello", instructions="be brief",
                                    max_output_tokens=40, temperature=0.3)
        out["whole"] = {"id": r.id, "object": r.object, "status": r.status,
                        "output_text": r.output_text, "model": r.model,
                        "output_types": [o.type for o in r.output],
                        "message_id": r.output[0].id, "role": r.output[0].role,
                        "usage": usage(r.usage), "instructions": r.instructions}

    if scenario("stream"):
        events = list(client.responses.create(
            model=model, stream=True,
            input=[{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "input_text", "text": "say hello"}]}]))
        out["stream"] = {
            "types": [e.type for e in events],
            "sequence": [e.sequence_number for e in events],
            "text": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
            "done_text": next(e.text for e in events if e.type == "response.output_text.done"),
            "final": events[-1].response.output_text,
            "status": events[-1].response.status,
            "usage": usage(events[-1].response.usage),
        }

    if scenario("helper"):
        deltas = []
        with client.responses.stream(model=model, input=[
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris"},
                {"role": "user", "content": "And of Italy?"}]) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = stream.get_final_response()
        out["helper"] = {"deltas": deltas, "text": final.output_text, "status": final.status,
                         "usage": usage(final.usage)}

    if scenario("tools"):
        tools_model = s["tools_model"]
        r = client.responses.create(model=tools_model, input="weather in Paris?", tools=[WEATHER])
        calls = [o for o in r.output if o.type == "function_call"]
        out["tools"] = {"calls": [{"name": c.name, "call_id": c.call_id,
                                   "arguments": json.loads(c.arguments), "id": c.id}
                                  for c in calls], "status": r.status}
        follow = client.responses.create(model=tools_model, tools=[WEATHER], input=[
            {"role": "user", "content": "weather in Paris?"},
            *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
               "arguments": c.arguments} for c in calls],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
              for c in calls]])
        out["tools"]["answer"] = follow.output_text
        with client.responses.stream(model=tools_model, input="weather in Rome?",
                                     tools=[WEATHER]) as stream:
            arg_deltas = [e.delta for e in stream
                          if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
        streamed = [o for o in final.output if o.type == "function_call"]
        out["tools"]["streamed"] = {"deltas": len(arg_deltas),
                                    "arguments": [json.loads(c.arguments) for c in streamed],
                                    "names": [c.name for c in streamed]}

    if scenario("structured"):
        schema = {"type": "object", "required": ["label"], "additionalProperties": False,
                  "properties": {"label": {"type": "string", "enum": ["blue", "grey"]}}}
        r = client.responses.create(model=s["structured_model"], input="the sky", text={
            "format": {"type": "json_schema", "name": "sky", "schema": schema, "strict": True}})

        class Sky(pydantic.BaseModel):
            label: Literal["blue", "grey"]

        parsed = client.responses.parse(model=s["structured_model"], input="the sky",
                                        text_format=Sky)
        out["structured"] = {"label": json.loads(r.output_text)["label"],
                             "parsed": parsed.output_parsed.label,
                             "usage": r.usage.total_tokens}

    if scenario("errors"):
        bad = openai.OpenAI(base_url=s["base_url"], api_key="not-the-key", max_retries=0)
        for name, call in [
            ("refused_key", lambda: bad.responses.create(model=model, input="hi")),
            ("refused_key_stream", lambda: list(bad.responses.create(model=model, input="hi",
                                                                     stream=True))),
            ("not_found", lambda: client.responses.create(model="no-such-model", input="hi")),
            ("previous", lambda: client.responses.create(model=model, input="hi",
                                                         previous_response_id="resp_123")),
            ("hosted_tool", lambda: client.responses.create(model=model, input="hi",
                                                            tools=[{"type": "web_search"}])),
        ]:
            try:
                call()
                out[name] = {"raised": None}
            except openai.APIError as e:
                out[name] = raised(e)

    if scenario("validated"):
        # The SDK builds its objects without validating them; here the raw bodies are
        # validated against the SDK's own types (pydantic, every required field, every
        # literal), whole and each streamed event: text, tool calls and a failure.
        events = pydantic.TypeAdapter(ResponseStreamEvent)
        whole = client.responses.with_raw_response.create(model=model, input="say hello")
        Response.model_validate(whole.http_response.json())
        checked = {"whole": 1}
        for name, m, tools in [("text", model, []), ("tools", s["tools_model"], [WEATHER]),
                               ("failed", s["mid_error"], [])]:
            with client.responses.with_streaming_response.create(
                    model=m, input="say hello", stream=True, tools=tools) as raw:
                types = []
                for line in raw.iter_lines():
                    if line.startswith("data: "):
                        event = events.validate_python(json.loads(line[len("data: "):]))
                        types.append(event.type)
                        if hasattr(event, "response"):
                            Response.model_validate(event.response.model_dump())
            checked[name] = types
        out["validated"] = checked

    if scenario("mid_error"):
        events = list(client.responses.create(model=s["mid_error"], input="hi", stream=True))
        out["mid_error"] = {
            "types": [e.type for e in events],
            "text": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
            "error": next((e.message for e in events if e.type == "error"), None),
            "failed": next((e.response.error.message for e in events
                            if e.type == "response.failed"), None),
        }

    if scenario("cancel"):
        # Reads the first text and closes the stream: the gateway must cancel the call.
        stream = client.responses.create(model=s["stall"], input="hi", stream=True)
        first = None
        for e in stream:
            if e.type == "response.output_text.delta":
                first = e.delta
                break
        stream.close()
        out["cancel"] = {"first": first}

    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
