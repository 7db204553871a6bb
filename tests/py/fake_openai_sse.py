"""A tiny, deterministic OpenAI-compatible chat-completions server, for running TrustGraph's
`text-completion-openai` without a real model, and in front of the real local LLM for the
compose stack test (scripts/test-stack.sh).

    python tests/py/fake_openai_sse.py --port 8767
    python tests/py/fake_openai_sse.py --host 172.17.0.1 --port 8769 \
        --upstream http://127.0.0.1:8766   # key: FAKE_UPSTREAM_API_KEY (env only)

Serves POST /v1/chat/completions (plain JSON, or Server-Sent Events when the request has
"stream": true, ending with a usage chunk and `data: [DONE]`) and GET /v1/models.
Prints `fake-openai listening on 127.0.0.1:<port>` on stdout once it accepts connections.

The reply is a function of the prompt (the text of the last user message):
  * a prompt containing "Final Answer:" (a ReAct agent prompt) gets
        Thought: I can answer directly.
        Final Answer: fake answer to <the last line of the prompt that is not blank>
    except that when that last line contains "use a tool" and the prompt has no
    "Observation:" yet (the agent's first step), the reply is a tool call:
        Thought: I will ask the tool.
        Action: ask-llm
        Args: {"question": "<that last line>"}
  * a prompt containing "[fake:429]" is refused with OpenAI's 429 (Retry-After: 0), one
    containing "[fake:500]" with a 500;
  * a prompt asking for JSON lines about "Block ID:"s (the built-in knowledge-classification
    template) gets one object per block, confidence 1.5 (clamped by sluice: a correction),
    then a line that is not JSON (skipped by sluice);
  * a prompt containing "[fake:echo]" gets `fake reply: <the prompt>` even with --upstream;
  * a prompt containing "[fake:slow]" streams a fixed text of 200 chunks, 100 ms apart;
  * a prompt containing "[fake:hold]" streams a fixed text of 10 chunks, 3 s apart: a long
    request that costs the broker little (a backlog of hundreds held at once);
  * any other prompt gets `fake reply: <the prompt>`, or, with --upstream, is forwarded to
    that OpenAI-compatible server (the real model) and its response relayed as it arrives.
Streams split the reply into chunks of at most 8 characters.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
UPSTREAM = None  # --upstream: where prompts that are not scripted go
SLOW_CHUNKS = 200
HOLD_CHUNKS, HOLD_GAP = 10, 3.0


def prompt_text(body):
    for message in reversed(body.get("messages", [])):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        return "".join(
            part.get("text", "") for part in content or [] if part.get("type") == "text"
        )
    return ""


def asks_for_block_lines(prompt):
    """The built-in knowledge-classification template's prompt."""
    return "JSON object per line" in prompt and "Block ID: " in prompt


def reply_for(prompt):
    if asks_for_block_lines(prompt):
        ids = [line.split("Block ID: ", 1)[1].strip() for line in prompt.splitlines()
               if line.startswith("Block ID: ")]
        lines = [json.dumps({"block_id": i, "is_knowledge": True, "confidence": 1.5,
                             "reason": "fake"}) for i in ids]
        return "\n".join(lines + ["this line is not JSON"]) + "\n"
    if "Final Answer:" in prompt:
        lines = [line.strip() for line in prompt.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if "use a tool" in last.lower() and "Observation:" not in prompt:
            args = json.dumps({"question": last})
            return f"Thought: I will ask the tool.\nAction: ask-llm\nArgs: {args}"
        return f"Thought: I can answer directly.\nFinal Answer: fake answer to {last}"
    return f"fake reply: {prompt}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("fake-openai: " + (fmt % args) + "\n")

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.rstrip("/").endswith("/models"):
            self.send_json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def relay(self, raw):
        """Forwards the request to the upstream server and relays its answer as it comes."""
        request = urllib.request.Request(
            UPSTREAM.rstrip("/") + "/v1/chat/completions", data=raw, method="POST",
            headers={"Content-Type": "application/json"})
        key = os.environ.get("FAKE_UPSTREAM_API_KEY")
        if key:
            request.add_header("Authorization", "Bearer " + key)
        try:
            upstream = urllib.request.urlopen(request, timeout=300)
        except urllib.error.HTTPError as e:
            upstream = e
        with upstream:
            self.send_response(upstream.status)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
            self.send_header("Connection", "close")
            self.end_headers()
            while True:
                line = upstream.readline()
                if not line:
                    break
                self.wfile.write(line)
                self.wfile.flush()
        self.close_connection = True

    def do_POST(self):
        try:
            self.answer()
        except (BrokenPipeError, ConnectionResetError):
            # The caller went away mid-answer (a cancelled stream, a killed replica).
            self.close_connection = True

    def answer(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length) or b"{}"
        body = json.loads(raw)
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self.send_json(404, {"error": {"message": "not found"}})
            return
        model = body.get("model", MODEL)
        prompt = prompt_text(body)
        if "[fake:429]" in prompt:
            data = json.dumps({"error": {"message": "Rate limit reached (fake)",
                                         "type": "requests", "code": "rate_limit_exceeded"}})
            self.send_response(429)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())
            return
        if "[fake:500]" in prompt:
            self.send_json(500, {"error": {"message": "The server had an error (fake)",
                                           "type": "server_error"}})
            return
        slow = "[fake:slow]" in prompt
        hold = "[fake:hold]" in prompt
        scripted = (slow or hold or "[fake:echo]" in prompt or "Final Answer:" in prompt
                    or asks_for_block_lines(prompt))
        if UPSTREAM and not scripted:
            self.relay(raw)
            return
        if slow:
            text = "".join(f"chunk {i:03}. " for i in range(SLOW_CHUNKS))
        elif hold:
            text = "".join(f"held {i:02}. " for i in range(HOLD_CHUNKS))
        else:
            text = reply_for(prompt)
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                 "total_tokens": len(prompt.split()) + len(text.split())}
        created = int(time.time())
        if not body.get("stream"):
            self.send_json(200, {
                "id": "chatcmpl-fake", "object": "chat.completion", "created": created,
                "model": model, "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()

        def event(obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                "created": created, "model": model}
        event(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}]})
        step = 11 if slow else 9 if hold else 8
        for i in range(0, len(text), step):
            if slow or hold:
                time.sleep(0.1 if slow else HOLD_GAP)
            event(base | {"choices": [{"index": 0, "delta": {"content": text[i:i + step]},
                                       "finish_reason": None}]})
        event(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        event(base | {"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--upstream", help="OpenAI-compatible server for unscripted prompts")
    args = parser.parse_args()
    global UPSTREAM
    UPSTREAM = args.upstream
    # Hundreds of replicas' requests may arrive at once (a backlog): a listen queue of 5,
    # the default, would drop connections and make the processors retry.
    ThreadingHTTPServer.request_queue_size = 1024
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake-openai listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
