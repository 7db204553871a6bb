"""A tiny, deterministic OpenAI-compatible chat-completions server, for running TrustGraph's
`text-completion-openai` without a real model.

    python tests/py/fake_openai_sse.py --port 8767

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
  * any other prompt gets `fake reply: <the prompt>`.
Streams split the reply into chunks of at most 8 characters.
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"


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


def reply_for(prompt):
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

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self.send_json(404, {"error": {"message": "not found"}})
            return
        model = body.get("model", MODEL)
        prompt = prompt_text(body)
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
        for i in range(0, len(text), 8):
            event(base | {"choices": [{"index": 0, "delta": {"content": text[i:i + 8]},
                                       "finish_reason": None}]})
        event(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        event(base | {"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8767)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake-openai listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
