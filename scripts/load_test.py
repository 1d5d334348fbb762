#!/usr/bin/env python3
"""A bounded load test of `mamba2 serve` (Python standard library only).

First each distinct prompt is sent once, alone, greedy: its reply is the expected text.
Then REQUESTS requests (the prompts in turn, every other one streamed) are sent by
CONCURRENCY clients at once. Every reply must have status 200 and equal its prompt's
expected text: a reply that does not is a mixed-up (or broken) stream. Prints one JSON
line: counts, p50/p99 latency, throughput. Exits 1 on any error or mismatch.

    mamba2 serve --port 8080 &
    python3 scripts/load_test.py --url http://127.0.0.1:8080 --requests 1000 --concurrency 64
"""

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor


def post(url, body, stream):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return r.status, None, 0, time.perf_counter() - t0, None
    first = None
    if not stream:
        v = json.loads(r.read())
        text = v["choices"][0]["text"]
        tokens = v["usage"]["completion_tokens"]
    else:
        text, tokens = "", None
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            v = json.loads(data)
            if "error" in v:
                return 500, None, 0, time.perf_counter() - t0, None
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
            if v["choices"]:
                piece = v["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
    conn.close()
    return 200, text, tokens or 0, time.perf_counter() - t0, first


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    prompts = [f"Fortune {i}: the {['wise', 'old', 'quick', 'happy'][i % 4]} one says" for i in range(a.prompts)]

    def body(i, stream):
        b = {"prompt": prompts[i], "max_tokens": a.max_tokens, "temperature": 0, "stream": stream}
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b

    expected = []
    for i in range(a.prompts):
        status, text, _, _, _ = post(a.url, body(i, False), False)
        if status != 200:
            sys.exit(f"the solo run of prompt {i} failed with status {status}")
        expected.append(text)

    def one(k):
        i, stream = k % a.prompts, k % 2 == 1
        status, text, tokens, secs, first = post(a.url, body(i, stream), stream)
        return status, text == expected[i], tokens, secs, first

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        results = list(pool.map(one, range(a.requests)))
    wall = time.perf_counter() - t0
    errors = sum(1 for s, *_ in results if s != 200)
    mixed = sum(1 for s, same, *_ in results if s == 200 and not same)
    lat = sorted(r[3] * 1e3 for r in results)
    ttft = sorted(r[4] * 1e3 for r in results if r[4] is not None)
    tokens = sum(r[2] for r in results)
    q = lambda v, f: v[min(len(v) - 1, round((len(v) - 1) * f))] if v else float("nan")
    report = {
        "requests": a.requests,
        "concurrency": a.concurrency,
        "max_tokens": a.max_tokens,
        "errors": errors,
        "mixed_up": mixed,
        "latency_p50_ms": round(q(lat, 0.5), 1),
        "latency_p99_ms": round(q(lat, 0.99), 1),
        "latency_mean_ms": round(statistics.fmean(lat), 1),
        "stream_ttft_p50_ms": round(q(ttft, 0.5), 1),
        "stream_ttft_p99_ms": round(q(ttft, 0.99), 1),
        "wall_s": round(wall, 2),
        "requests_per_s": round(a.requests / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
    }
    print(json.dumps(report))
    sys.exit(1 if errors or mixed else 0)


if __name__ == "__main__":
    main()
