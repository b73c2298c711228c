#!/usr/bin/env python3
"""Starts `kda serve` on a free port and checks it from outside, as a client would: greedy
completions sent all at once (interleaved by the server's scheduler) must equal the same
requests sent one at a time, streamed answers must equal whole ones, and the repeated prompt
must be served from the prefix cache where the backend can snapshot sessions. Standard library
only (runs on the GPU machine too).

    python3 scripts/serve_check.py BINARY MODEL_DIR [extra kda serve options, e.g. --device cuda]
"""
import json
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = ["The jury said that the city", "It was", "In the morning, the men of", "The man",
           "Several members said that", "A", "The committee met on Tuesday", "When the"]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def main():
    binary, model = sys.argv[1], sys.argv[2]
    server = subprocess.Popen([binary, "serve", "-m", model, "--port", "0", "--parallel", "3"] +
                              sys.argv[3:], stderr=subprocess.PIPE, text=True)
    port = 0
    start = time.time()
    while not port and time.time() - start < 120:
        line = server.stderr.readline()
        print(line.rstrip())
        if "http://" in line:
            port = int(line.split("http://")[1].split(":")[1].split(",")[0])
    assert port, "the server did not say where it listens"
    failures = 0
    try:
        body = lambda p: {"prompt": p, "max_tokens": 24, "temperature": 0}
        t0 = time.time()
        alone = [json.loads(post(port, "/v1/completions", body(p))) for p in PROMPTS]
        alone_seconds = time.time() - t0
        together = [None] * len(PROMPTS)

        def ask(i):
            together[i] = json.loads(post(port, "/v1/completions", body(PROMPTS[i])))
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.time() - t0
        for p, a, b in zip(PROMPTS, alone, together):
            same = a["choices"][0]["text"] == b["choices"][0]["text"]
            failures += not same
            print(f"{'PASS' if same else 'FAIL'} interleaved == alone: {p!r} -> "
                  f"{b['choices'][0]['text']!r} (cached {b['usage']['prompt_tokens_details']['cached_tokens']})")
        streamed = post(port, "/v1/completions", dict(body(PROMPTS[0]), stream=True))
        text = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in streamed.split("\n\n") if line.startswith("data: {"))
        same = text == alone[0]["choices"][0]["text"]
        failures += not same
        print(f"{'PASS' if same else 'FAIL'} streamed == whole")
        tokens = sum(r["usage"]["completion_tokens"] for r in together)
        print(f"{len(PROMPTS)} requests one at a time: {tokens} tokens in {alone_seconds:.2f} s "
              f"({tokens / alone_seconds:.1f} tokens/s); all at once: {seconds:.2f} s "
              f"({tokens / seconds:.1f} tokens/s over all; the repeats partly from the prefix cache)")
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"serve_check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
