#!/usr/bin/env python3
"""Writes the seed corpora under corpus/<target>/ (run from fuzz/; the output is committed).

Each seed is [selector, split, body...] (see src/lib.rs). The bodies are the wire formats of
the fake providers (tests/src/fake_*.rs), example streams of JSON lines split mid-token as SSE
and NDJSON deltas (docs/protocol.md#streamed-json-lines) and the providers' documented wire
formats.
"""
import json, os, struct, zlib

def put(target, name, selector, split, body):
    d = os.path.join("corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(body, str):
        body = body.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes([selector, split]) + body)

def j(v):
    return json.dumps(v, separators=(",", ":"))

# --- records ---------------------------------------------------------------------------
records = [
    (0, {"system": "Be brief.", "prompt": "Hi", "streaming": True}),
    (0, {"system": None, "prompt": "x", "streaming": None, "response_format": "json", "schema": {"type": "object"}}),
    (1, {"id": "question", "terms": {"question": "\"why?\"", "n": 3}, "streaming": True}),
    (1, {"id": "extract", "terms": None}),
    (2, {"question": "What is 2+2?", "state": "", "group": ["default"], "history": [
        {"thought": "t", "action": "calc", "arguments": {"x": "1"}, "observation": "2"}], "streaming": True}),
    (3, {"response": "Hel", "end_of_stream": False, "in_token": 3, "out_token": None, "model": "m", "error": None}),
    (3, {"response": "", "end_of_stream": True, "error": {"type": "rate-limit", "message": "slow down"}}),
    (4, {"text": "a", "object": None, "end_of_stream": True, "error": None}),
    (5, {"chunk_type": "thought", "content": "hmm", "end_of_message": False, "end_of_dialog": False, "error": None}),
    (5, {"message_type": "answer", "answer": "4", "end_of_dialog": True}),
]
for i, (sel, rec) in enumerate(records):
    put("records", f"r{i}", sel, 0, j(rec))

# --- SSE providers ---------------------------------------------------------------------
def data(v):
    return f"data: {v if isinstance(v, str) else j(v)}\n\n"
def ev(name, v):
    return f"event: {name}\ndata: {j(v)}\n\n"

openai = (data({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
          + data({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]})
          + data({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]})
          + data({"choices": [], "usage": {"prompt_tokens": 37, "completion_tokens": 12}})
          + "data: [DONE]\n\n")
azure = (data({"id": "", "choices": [], "prompt_filter_results": [{}]})
         + data({"choices": [{"index": 0, "content_filter_results": {}}]})
         + ": keep-alive\n\n" + data({"choices": None, "usage": {"prompt_tokens": 1, "completion_tokens": 2}}))
openai_err = data({"choices": [{"delta": {"content": "Hi"}}]}) + data({"error": {"message": "overloaded", "type": "server_error"}})
seed002 = ("data: {\"choices\":[{\"delta\":{\"content\":\"{\"}}]}\n"
           "data: {\"choices\":[{\"delta\":{\"content\":\"block_id\"}}]}\n"
           "data: {\"choices\":[{\"delta\":{\"content\":\":\\\"abc123\"}}]}\n\r\n")
anthropic = (ev("message_start", {"type": "message_start", "message": {"id": "msg_1", "role": "assistant", "content": [], "usage": {"input_tokens": 25, "output_tokens": 1}}})
             + ev("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
             + ev("ping", {"type": "ping"})
             + ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}})
             + ev("content_block_stop", {"type": "content_block_stop", "index": 0})
             + ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 15}})
             + ev("message_stop", {"type": "message_stop"}))
anthropic_err = (ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}})
                 + ev("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))
gemini = (data({"candidates": [{"content": {"parts": [{"text": "The"}], "role": "model"}, "index": 0}], "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9}})
          + data({"candidates": [{"content": {"parts": [{"text": " end"}], "role": "model"}, "finishReason": "STOP", "index": 0}],
                  "usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 2, "totalTokenCount": 11, "cachedContentTokenCount": 1}}))
gemini_block = data({"promptFeedback": {"blockReason": "SAFETY"}}) + data({"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}})
cohere = (ev("message-start", {"type": "message-start", "id": "m1", "delta": {"message": {"role": "assistant"}}})
          + ev("content-start", {"type": "content-start", "index": 0, "delta": {"message": {"content": {"type": "text", "text": ""}}}})
          + ev("content-delta", {"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": "Hi"}}}})
          + ev("citation-start", {"type": "citation-start", "index": 0})
          + ev("content-end", {"type": "content-end", "index": 0})
          + ev("message-end", {"type": "message-end", "delta": {"finish_reason": "COMPLETE", "usage": {"billed_units": {"input_tokens": 5, "output_tokens": 2}, "tokens": {"input_tokens": 10, "output_tokens": 2}}}})
          + "data: [DONE]\n\n")
for name, sel, body in [("openai", 0, openai), ("azure", 0, azure), ("openai_err", 0, openai_err), ("seed002", 0, seed002),
                        ("anthropic", 1, anthropic), ("anthropic_err", 1, anthropic_err), ("gemini", 2, gemini),
                        ("gemini_block", 2, gemini_block), ("cohere", 3, cohere)]:
    put("sse", name, sel, 0, body)
    put("sse", name + "_split", sel, 7, body)

# --- Ollama / NDJSON -------------------------------------------------------------------
def oline(text, done=False):
    v = {"model": "m", "created_at": "2024-01-01T00:00:00Z", "message": {"role": "assistant", "content": text}, "done": done}
    if done:
        v.update({"done_reason": "stop", "prompt_eval_count": 26, "eval_count": 298})
    return j(v) + "\n"
ollama = oline("The") + oline(" sky") + "\n" + oline("", True)
put("ollama", "stream", 0, 0, ollama)
put("ollama", "stream_split", 0, 5, ollama.replace("\n", "\r\n", 1))
put("ollama", "error", 0, 3, oline("Hi") + j({"error": "model runner crashed"}) + "\n")
put("ollama", "lines", 1, 4, "{\"a\":1}\n\n{\"b\":\"\xc3\xa9\"}\r\nno newline")
put("ollama", "long_line", 9, 2, "x" * 40 + "\n" + "short\n")

# --- Bedrock event stream --------------------------------------------------------------
def frame(headers, payload):
    h = b""
    for name, value in headers:
        nb, vb = name.encode(), value.encode()
        h += bytes([len(nb)]) + nb + bytes([7]) + struct.pack(">H", len(vb)) + vb
    p = j(payload).encode()
    total = 12 + len(h) + len(p) + 4
    prelude = struct.pack(">II", total, len(h))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    msg = prelude + h + p
    return msg + struct.pack(">I", zlib.crc32(msg))
def bev(kind, payload):
    return frame([(":event-type", kind), (":content-type", "application/json"), (":message-type", "event")], payload)
conv = (bev("messageStart", {"role": "assistant"})
        + bev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hello"}})
        + bev("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "hm"}}})
        + bev("contentBlockStop", {"contentBlockIndex": 0})
        + bev("messageStop", {"stopReason": "end_turn"})
        + bev("metadata", {"usage": {"inputTokens": 7, "outputTokens": 3, "cacheReadInputTokens": 2}, "metrics": {"latencyMs": 5}}))
exc = bev("contentBlockDelta", {"delta": {"text": "Hi"}}) + frame([(":exception-type", "throttlingException"), (":content-type", "application/json"), (":message-type", "exception")], {"message": "Too many requests"})
err = frame([(":message-type", "error"), (":error-code", "InternalFailure"), (":error-message", "boom")], {})
put("bedrock", "conversation", 0, 0, conv)
put("bedrock", "conversation_split", 0, 11, conv)
put("bedrock", "exception", 0, 3, exc)
put("bedrock", "error", 0, 0, err)
put("bedrock", "huge_length", 0, 0, struct.pack(">II", 0xFFFFFFF0, 0) + struct.pack(">I", zlib.crc32(struct.pack(">II", 0xFFFFFFF0, 0))) + b"\0" * 8)

# --- prompt jsonl / extraction / normalisers --------------------------------------------
put("jsonl", "lines", 0, 3, "```json\n{\"block_id\":\"abc123\",\"category\":\"greeting\",\"confidence\":1.7}\nnot json\n\n[1,2]\n{\"block_id\":\"b\",\"category\":\"x\",\"confidence\":0.5}\n```\n")
put("jsonl", "rewording", 1, 0, "Here you go:\n{\"block_id\":\"a\",\"original\":\"Hi\",\"reworded\":\"Hello\",\"changes\":[]}\n")
put("jsonl", "integration", 2, 5, "```json\n{\"summary\":\"s\",\"blocks\":[{\"block_id\":\"a\",\"content\":\"c\",\"targets\":[]}],\"warnings\":null}\n```")
put("jsonl", "prose", 0, 0, "The answer is [ {\"a\": 1} ] and {\"b\": 2}")

# --- ReAct ----------------------------------------------------------------------------
react = [
    "Thought: I need to add.\nAction: calculator\nArgs: {\"expression\": \"2+2\", \"n\": 3}\n",
    "Thought: done\nFinal Answer: 4\n",
    "**Thought:** hmm\n**Action:** `search`\nArgs:\n```json\n{\"q\": \"rust\"}\n```\n",
    "Final Answer: just this\r\nwith two lines",
    "Thought: a\nThought: b\n",
    "Action: None\nFinal Answer: none",
    "Thought: x\nAction: \"tool\"\nArgs: {\"a\": [1, {\"b\": null}]} trailing",
]
for i, t in enumerate(react):
    put("react", f"r{i}", 0, 0, t)
    put("react", f"r{i}_split", 0, 1 + i * 3, t)

# --- MCP ------------------------------------------------------------------------------
tools_list = {"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add", "description": "Adds", "inputSchema": {"type": "object"}}], "nextCursor": "c2"}}
call = {"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "4"}, {"type": "image", "mimeType": "image/png", "data": ""},
        {"type": "resource", "resource": {"uri": "file:///a", "text": "A"}}], "structuredContent": {"v": 4}, "isError": False}}
put("mcp", "json_tools", 0, 0, j(tools_list))
put("mcp", "json_batch", 0, 4, j([{"jsonrpc": "2.0", "method": "notifications/progress"}, call]))
put("mcp", "json_error", 0, 0, j({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}))
put("mcp", "sse_call", 1, 0, "id: 0\nretry: 1000\ndata:\n\n" + "event: message\ndata: " + j({"jsonrpc": "2.0", "method": "notifications/message", "params": {}}) + "\n\n" + "data: " + j(call) + "\n\n")
put("mcp", "sse_split", 1, 9, "data: " + j(tools_list) + "\r\n\r\n")

# --- gateway --------------------------------------------------------------------------
put("gateway", "tc_json", 0, 0, j({"system": "", "prompt": "Hi"}))
put("gateway", "prompt_ndjson", 1, 1, j({"id": "question", "terms": {"question": "\"why\""}}))
put("gateway", "agent_sse", 2, 2, j({"question": "2+2?", "history": []}))
put("gateway", "flow", 3, 0, j({"id": "q", "terms": {}}))
put("gateway", "bad", 0, 1, "{\"prompt\": ")
put("gateway", "chat", 5, 2, j({"model": "smollm2", "stream": True, "max_tokens": 16, "temperature": 0.2,
    "stream_options": {"include_usage": True}, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Why?"}]}))
put("gateway", "chat_bad", 5, 0, j({"model": 3, "messages": [{"role": "tool"}]}))
put("gateway", "ollama_chat", 6, 1, j({"model": "smollm2", "stream": True, "format": "json",
    "options": {"temperature": 0.3, "num_ctx": "{config.llm.num_ctx}", "num_predict": -1, "stop": ["\n\n"]},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"q": "x"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]}))
put("gateway", "ollama_generate", 7, 2, j({"model": "smollm2", "prompt": "Hi", "system": "s", "stream": False,
    "format": {"type": "object"}, "keep_alive": "5m", "options": {"top_p": 1.0, "seed": 3}}))
put("gateway", "anthropic_messages", 8, 2, j({"model": "smollm2", "max_tokens": 64, "stream": True,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "temperature": 0.3, "stop_sequences": ["END"], "metadata": {"user_id": "u"},
    "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
            "content": [{"type": "text", "text": "sunny"}], "is_error": False}, {"type": "text", "text": "thanks"}]}]}))
put("gateway", "anthropic_bad", 8, 0, j({"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}], "top_k": 3}))
put("gateway", "responses", 8, 2, j({"model": "smollm2", "stream": True, "instructions": "Be brief.",
    "max_output_tokens": 64, "temperature": 0.2, "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}],
    "tool_choice": "auto", "input": [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}))
put("gateway", "responses_bad", 8, 0, j({"model": "m", "input": [{"type": "function_call_output"}], "previous_response_id": 3}))

# --- config / templates / tools --------------------------------------------------------
put("config", "toml", 0, 0, "model = \"smollm2\"\nbase-url = \"http://127.0.0.1:8766\"\nmax-tokens = 64\ntemperature = 0.5\ntopic = [\"a\", \"b\"]\nno-stream-usage = true\nlog-format = \"json\"\n")
put("config", "toml_bad", 0, 0, "model = \"unterminated\nkey = é\n")
put("config", "templates", 1, 0, j({"system": "You are helpful.", "templates": {
    "question": {"prompt": "Answer: {{ question }}", "response-type": "text"},
    "extract": {"prompt": "{% for k in [1,2] %}{{ text }}{{ k }}{% endfor %}", "response-type": "json", "schema": {"type": "object"}}}}))
put("config", "templates_trustgraph", 1, 0, j({"system": "\"Be brief.\"", "template-index": ["t"],
    "template.t": {"prompt": "{{ text | upper }}", "response-type": "jsonl", "system": "s"}}))
put("config", "tools", 2, 0, j({"tools": [
    {"name": "add", "description": "Adds two numbers", "type": "mcp", "url": "http://127.0.0.1:1/mcp", "tool": "add", "token-env": "T",
     "arguments": [{"name": "a", "type": "number"}, {"name": "b", "type": "number"}]},
    {"name": "ask", "description": "Asks", "type": "text-completion", "system": "s", "arguments": [{"name": "question", "type": "string"}]},
    {"name": "facts", "description": "Facts", "type": "prompt", "template": "facts", "group": ["default", "x"], "applicable-states": ["a"], "next-state": "b"},
    {"name": "lookup", "description": "Looks up", "type": "service", "request-topic": "q", "response-topic": "r"}]}))
for f in sorted(os.listdir("../deploy/compose")):
    if f.endswith(".toml"):
        with open(os.path.join("../deploy/compose", f)) as fh:
            # The split byte picks the subcommand (SUBCOMMANDS in src/bin/config.rs).
            sub = ["text-completion", "prompt", "agent", "gateway", "serve"].index(f[:-5])
            put("config", "deploy_" + f[:-5], 0, sub, fh.read())

# --- tgconfig: TrustGraph's config service ---------------------------------------------
put("tgconfig", "response_values", 0, 0, j({"version": 3, "values": [
    {"workspace": "default", "key": "processor:text-completion", "value": j({"topics": {
        "request": "request:tg:text-completion", "response": "response:tg:text-completion"},
        "parameters": {"model": "gpt-4o", "temperature": "0.2"}})}], "error": None}))
put("tgconfig", "response_error", 0, 0, j({"error": {"type": "not-found", "message": "no such key"}}))
put("tgconfig", "push", 1, 0, j({"version": 7, "changes": {"processor:text-completion": ["default"]},
    "workspace_changes": {"created": ["w2"], "deleted": []}}))
put("tgconfig", "flow", 2, 0, j({"topics": {"request": "request:tg:text-completion",
    "response": "persistent://tg/response/x", "text-completion-request": "non-persistent://tg/request/y"},
    "parameters": {"model": "smollm2", "max-tokens": 64, "streaming": True, "x": None}}))
put("tgconfig", "templates", 3, 0, j({"system": "\"Be brief.\"",
    "template.question": j({"prompt": "Answer: {{ question }}", "response-type": "text"}),
    "template.extract": j({"prompt": "Extract from {{ text }}", "response-type": "json",
                           "schema": {"type": "object"}}),
    "template-index": "[\"question\", \"extract\"]"}))

# --- socket: the gateway's WebSocket frames (TrustGraph's api-gateway protocol) ------------
put("socket", "auth", 0, 0, j({"type": "auth", "token": "secret"}))
put("socket", "text_completion", 0, 0, j({"id": "req-1", "service": "text-completion", "flow": "default",
    "request": {"system": "", "prompt": "hi", "streaming": True}}))
put("socket", "prompt", 0, 0, j({"id": "req-2", "service": "prompt",
    "request": {"id": "question", "terms": {"question": "\"why?\""}, "streaming": True}}))
put("socket", "agent", 0, 0, j({"id": "req-3", "service": "agent", "flow": "default",
    "request": {"question": "2+2?", "history": [], "streaming": True}}))
put("socket", "wrong_flow", 1, 0, j({"id": "req-4", "service": "agent", "flow": "default", "request": {}}))
put("socket", "bad", 0, 0, j({"id": 5, "service": "nope"}))

# --- shared: what the gateway and the ledger read from others (src/bin/shared.rs) ---------
# 0: a resume header (<token>.<events received>), 1: a keys file, 2: a limit snapshot (read
# at 2026-11-28 10:00:30 UTC with split 0), 3: a usage record.
put("shared", "resume", 0, 0, "v2.text-completion.7:3:0:0.1795860000.0af7651916cd43dd8448eb211c80319c.AAAAAAAAAAAAAAAAAAAAAA.req-1.5")
put("shared", "resume_no_trace", 0, 0, "v2.agent.-.1795860000.-.c2VhbHNlYWxzZWFsc2VhbA.a.b.c.0")
put("shared", "resume_v1", 0, 0, "v1.text-completion.7:3:0:0.1795860000.req-1.5")
put("shared", "keys", 1, 0, "[[keys]]\nname = \"team-a\"\nsha256 = \"" + "ab" * 32 + "\"\n"
    "services = [\"text-completion\", \"agent\"]\nmodels = [\"gpt-4o-mini\"]\nflows = [\"default\"]\n"
    "tool_groups = [\"default\", \"research\"]\noperator_fields = [\"retry\"]\n"
    "requests_per_minute = 60\ntokens_per_minute = 20000\ntokens_per_day = 1000000\n"
    "[[keys]]\nname = \"k\"\nsha256 = \"" + "5c" * 32 + "\"\n")
counts = {"minute": 29931000, "requests": 3, "tokens": 700, "prev_requests": 1, "prev_tokens": 50,
          "day": 20785, "day_tokens": 9000, "month": 682, "month_tokens": 90000, "in_flight": 1}
put("shared", "snapshot", 2, 0, j({"replica": "r1", "key": "k", "seq": 1795860030000000,
                                   "counts": counts, "sent_ms": 1795860030000}))
put("shared", "snapshot_ahead", 2, 0, j({"replica": "r2", "key": "k", "seq": 1,
    "counts": dict(counts, minute=29931100, month_tokens=18446744073709551615)}))
put("shared", "snapshot_unknown", 2, 0, j({"replica": "r3", "key": "nobody", "seq": 1, "counts": counts}))
put("shared", "usage", 3, 0, j({"id": "req-1", "attempt": "a1", "key": "team-a", "trace_id": "0af7",
    "flow": "default/default", "service": "text-completion", "model": "gpt-4o-mini",
    "provider": "openai", "streaming": True, "input_tokens": 37, "output_tokens": 12,
    "estimated": False, "outcome": "answered", "error": None, "duration_ms": 812,
    "ended_at_ms": 1795860030000, "cost": 0.000123}))
# Found by the fuzzer (serde_json reads this cost one unit in the last place away from the
# nearest double): kept as a seed, byte for byte as it was found.
put("shared", "usage_cost_ulp", 3, 0, '{"id":"req-1","attempt":"a1","key":"te","trace_id":"0af7",'
    '"flow":"ult","service":"-completion","model":"gpt-4o-mini","provider":"oi","streaming":true,'
    '"input_tokens":37,"output_tokens":12,"estimated":false,"outcome":"aned","error":null,'
    '"duration_ms":812,"ended_at_ms":1795860030000,"cost":0.0000000000000000000000000123}')
