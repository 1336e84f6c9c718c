"""A stand-in for a vLLM OpenAI-compatible server, for testing the `prompt_logprobs` path offline.

    python mock_vllm.py PORT VOCAB LOG.jsonl [TOKENIZER.json]

/v1/completions with `prompt_logprobs` returns, like vLLM, one entry per prompt token: null
first, then {token id: {"logprob", "rank", "decoded_token"}} holding the top-k of a fixed
function of the previous token, plus the prompt's own token when it is outside them. Echo is
refused (400), so a client can only use the id path. Every answer to a prompt of ids is appended
to LOG.jsonl. With TOKENIZER, /v1/chat/completions answers like a reasoning model behind vLLM:
`reasoning_content` beside the content, and `logprobs.content` with token strings and their
top_logprobs (the answer's ids are logged too).
"""
import json
import math
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

PORT, VOCAB, LOG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
PIECES = None
if len(sys.argv) > 4:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(sys.argv[4])
    PIECES = [tok.decode([i], skip_special_tokens=False) for i in range(VOCAB)]
    FIRST = {}
    for i, p in enumerate(PIECES):
        FIRST.setdefault(p, i)
    # Ids whose text maps back to them (the lowest id of a shared text).
    USABLE = [i for i, p in enumerate(PIECES) if FIRST[p] == i and p]


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
        if self.path == "/v1/chat/completions" and PIECES is not None:
            return self.chat(body)
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


    def chat(self, body):
        n = min(int(body.get("max_tokens", 8)), 6)
        k = int(body.get("top_logprobs", 3))
        seed = sum(ord(c) for c in body["messages"][-1]["content"])
        ids, content = [], []
        prev = seed
        for _ in range(n):
            lp = logprobs_after(prev)
            order = sorted(USABLE, key=lambda j: (-lp[j], j))
            nxt = order[0]
            ids.append(nxt)
            content.append({"token": PIECES[nxt], "logprob": lp[nxt],
                            "top_logprobs": [{"token": PIECES[j], "logprob": lp[j]} for j in order[:k]]})
            prev = nxt
        with open(LOG, "a") as f:
            f.write(json.dumps({"chat_ids": ids}) + "\n")
        msg = {"role": "assistant", "content": "".join(PIECES[i] for i in ids),
               "reasoning_content": f"The user wants {len(ids)} tokens; think, then answer."}
        self.reply(200, {"choices": [{"message": msg, "logprobs": {"content": content}}]})


HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
