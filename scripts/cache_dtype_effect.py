#!/usr/bin/env python3
"""What storing prefix-cache entries in f16 does to the tokens (Python standard library).

For each of PROMPTS prompts: request A (the prompt), then request B (the prompt, A's reply
and a few more words), greedy, so that B resumes from the state cached at A's end. Run it
against servers started without a cache, with f32 host entries and with f16 host entries
(`--cache-device-mem 0 [--cache-dtype f16]`); it prints B's replies and cached-token
counts as JSON, and with --compare, how many replies of each file equal the first's.

    python3 scripts/cache_dtype_effect.py --url http://127.0.0.1:8080 > f32.json
    python3 scripts/cache_dtype_effect.py --compare none.json f32.json f16.json
"""

import argparse
import http.client
import json
import urllib.parse


def complete(url, prompt, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    v = json.loads(r.read())
    if r.status != 200:
        raise SystemExit(f"status {r.status}: {v}")
    return v["choices"][0]["text"], v["usage"]["prompt_tokens_details"]["cached_tokens"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--compare", nargs="+")
    a = p.parse_args()
    if a.compare:
        runs = [json.load(open(f)) for f in a.compare]
        base = runs[0]["replies"]
        for f, r in zip(a.compare, runs):
            same = sum(x == y for x, y in zip(base, r["replies"]))
            print(json.dumps({"file": f, "equal_to_first": same, "of": len(base),
                              "cached_tokens": sum(r["cached"])}))
        return
    replies, cached = [], []
    for i in range(a.prompts):
        prompt = f"Fortune {i}: the {['wise', 'old', 'quick', 'happy'][i % 4]} one says"
        first, _ = complete(a.url, prompt, a.max_tokens)
        text, hit = complete(a.url, prompt + first + " And", a.max_tokens)
        replies.append(text)
        cached.append(hit)
    print(json.dumps({"replies": replies, "cached": cached}))


if __name__ == "__main__":
    main()
