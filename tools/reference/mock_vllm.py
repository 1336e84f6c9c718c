"""A stand-in for a vLLM OpenAI-compatible server, for testing the `prompt_logprobs` path offline.

    python mock_vllm.py PORT VOCAB LOG.jsonl

/v1/completions with `prompt_logprobs` returns, like vLLM, one entry per prompt token: null
first, then {token id: {"logprob", "rank", "decoded_token"}} holding the top-k of a fixed
function of the previous token, plus the prompt's own token when it is outside them. Echo is
refused (400) and chat is absent (404), so a client can only use the id path. Every answer to a
prompt of ids is appended to LOG.jsonl.
"""
import json
import math
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

PORT, VOCAB, LOG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def logprobs_after(prev):
    logits = [3.0 * math.sin(prev * 0.37 + j * 1.3) + 0.5 * math.cos(j * 0.11) for j in range(VOCAB)]
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply(200, {"data": [{"id": "mock-vllm"}]})
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self.reply(404, {"error": "not found"})
        if body.get("echo"):
            return self.reply(400, {"error": "echo is not supported here"})
        k = body.get("prompt_logprobs")
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else [ord(c) % VOCAB for c in prompt]
        pl = None
        if k is not None:
            pl = [None]
            for i in range(1, len(ids)):
                lp = logprobs_after(ids[i - 1])
                order = sorted(range(VOCAB), key=lambda j: (-lp[j], j))
                keep = order[:k] + ([ids[i]] if ids[i] not in order[:k] else [])
                pl.append({str(j): {"logprob": lp[j], "rank": order.index(j) + 1, "decoded_token": f"<{j}>"} for j in keep})
            if isinstance(prompt, list):
                with open(LOG, "a") as f:
                    f.write(json.dumps({"ids": ids, "prompt_logprobs": pl}) + "\n")
        self.reply(200, {"choices": [{"text": "x", "prompt_logprobs": pl, "logprobs": None}],
                         "usage": {"prompt_tokens": len(ids)}})


HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
