#!/usr/bin/env python3
"""Train the tiny Mamba2 model shipped in assets/ (HF transformers Mamba2ForCausalLM, n_groups 1, tied
embeddings, f16 safetensors) on Debian's fortune cookies.

Reproduce (from the repo root):
    bash scripts/fetch_corpus.sh                                   # writes .corpus/fortunes.txt
    python3 scripts/train_tiny.py --out assets --max-seconds 330   # on one GPU (H200: about 6 minutes)
    python3 scripts/train_tiny.py --smoke --out /tmp/a --heldout-out /tmp/heldout.txt   # CPU pipeline test

Pipeline
1. Corpus: .corpus/fortunes.txt, cookies separated by lines holding a single `%` (the file is a
   sequence of `cookie + "\\n%\\n"`).
2. Split (depends only on --seed and the corpus): the cookie indices are shuffled with
   random.Random(seed); the first 5% are the test split, the next 3% the validation split (used only to
   keep the best checkpoint), the rest the training split.
3. Tokenizer: byte-level BPE (tokenizers library: ByteLevel pre-tokenizer without prefix space,
   ByteLevel decoder, no normalizer; post-processor: <|endoftext|> as BOS with special tokens), vocab 4096 including the special token
   `<|endoftext|>` = id 0, trained on the training cookies only; saved as <out>/tokenizer.json.
4. Token stream of a split (train, val, test alike): `<|endoftext|>` before every cookie and one after
   the last, i.e. the text EOT + EOT.join(cookies) + EOT, where EOT = "<|endoftext|>".
   `<|endoftext|>` is the separator between cookies and the BOS/EOS.
5. Held-out text: tests/data/heldout.txt is exactly that text for the longest prefix of the test
   cookies whose file stays <= 200,000 bytes (UTF-8, no trailing newline). The test split is used for
   nothing else.
6. Training: random init (seed), AdamW, cosine LR with linear warmup, sequence length 256, windows of
   257 tokens cut from the shuffled-cookie training stream at a random offset per epoch; stops at the
   planned number of steps (an epoch cap, shrunk to fit the time budget after timing the first steps)
   or at the deadline, whichever comes first. The selective scan used for TRAINING is an
   einsum version of HF's chunked SSD (same math, checked against HF's at start-up); evaluation and
   generation use HF's own code.
7. Saving: the model with the best validation loss, cast to f16, `save_pretrained` (config.json,
   model.safetensors without lm_head.weight since the embeddings are tied, generation_config.json).

Held-out figure (what the Rust engine must reproduce within 1 %):
    ids = tokenizer.encode(open("tests/data/heldout.txt").read()).ids   # ONE string, no special
                                                                        # tokens added (<|endoftext|>
                                                                        # in the text maps to id 0)
    cut ids into consecutive non-overlapping windows of ctx = 256 tokens: ids[0:256], ids[256:512], ...;
    the last, shorter window is kept if it has >= 2 tokens;
    each window runs from a fresh (zero) state (conv and SSM);
    heldout_nll = mean over every predicted position of every window (positions 1..len-1, predicted
                  from logits at 0..len-2) of -log softmax(logits)[next id]   (natural log)
    heldout_ppl = exp(heldout_nll)
computed with the saved f16 weights loaded back and upcast to f32, run in f32 (TF32 off) with HF's
Mamba2ForCausalLM on the training device.
"""

import argparse
import copy
import json
import math
import os
import platform
import random
import sys
import time

os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch
import torch.nn.functional as F

T0 = time.time()
EOT = "<|endoftext|>"
CTX = 256
HELDOUT_MAX_BYTES = 200_000


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def read_cookies(path):
    text = open(path, encoding="utf-8").read()
    assert text.endswith("\n%\n"), "corpus must be cookie + '\\n%\\n' records"
    cookies = text[: -len("\n%\n")].split("\n%\n")
    assert all(c.strip() for c in cookies)
    return cookies, len(text.encode("utf-8"))


def split(cookies, seed, test_frac=0.05, val_frac=0.03):
    idx = list(range(len(cookies)))
    random.Random(seed).shuffle(idx)
    n_test = round(len(idx) * test_frac)
    n_val = round(len(idx) * val_frac)
    test = [cookies[i] for i in idx[:n_test]]
    val = [cookies[i] for i in idx[n_test:n_test + n_val]]
    train = [cookies[i] for i in idx[n_test + n_val:]]
    return train, val, test


def stream_text(cookies):
    return EOT + EOT.join(cookies) + EOT


def heldout_text(test_cookies):
    """Longest prefix of the test cookies whose stream text is <= HELDOUT_MAX_BYTES bytes."""
    n, size = 0, len(EOT.encode())
    for c in test_cookies:
        add = len(c.encode("utf-8")) + len(EOT.encode())
        if size + add > HELDOUT_MAX_BYTES:
            break
        size += add
        n += 1
    text = stream_text(test_cookies[:n])
    assert len(text.encode("utf-8")) == size
    return text, n


def train_tokenizer(train_cookies, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_cookies, trainer=trainer)
    assert tok.token_to_id(EOT) == 0
    return tok


def encode_stream(tok, cookies):
    """Same ids as tok.encode(stream_text(cookies)).ids (checked in main), built per cookie."""
    ids = [0]
    for enc in tok.encode_batch(cookies, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return ids


# --------------------------------------------------------------------------------------------
# fast chunked scan for training (einsum form of the SSD algorithm; same math as HF's torch path)
# --------------------------------------------------------------------------------------------
def _segsum(x):
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    s = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0)
    return s.masked_fill(~mask, -torch.inf)


def fast_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Drop-in for transformers' mamba2_chunk_scan (hidden_states [b,t,h,p], dt [b,t,h], A [h],
    B/C [b,t,g,n])."""
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        b, t, h, p = hidden_states.shape
        g = B.shape[2]
        dt = dt.float()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        if dt_softplus:
            dt = F.softplus(dt)
        if dt_limit[0] > 0.0 or dt_limit[1] != float("inf"):
            dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        x = hidden_states.float()
        B = B.float()
        C = C.float()
        pad = (chunk_size - t % chunk_size) % chunk_size
        xd = x * dt[..., None]
        a = A.float()[None, None, :] * dt  # [b, t, h]
        if pad:
            xd = F.pad(xd, (0, 0, 0, 0, 0, pad))
            a = F.pad(a, (0, 0, 0, pad))
            B = F.pad(B, (0, 0, 0, 0, 0, pad))
            C = F.pad(C, (0, 0, 0, 0, 0, pad))
        c = (t + pad) // chunk_size
        l = chunk_size
        xd = xd.reshape(b, c, l, h, p)
        a = a.reshape(b, c, l, h).permute(0, 3, 1, 2)  # [b, h, c, l]
        B = B.reshape(b, c, l, g, -1)
        C = C.reshape(b, c, l, g, -1)
        hpg = h // g
        a_cum = torch.cumsum(a, dim=-1)
        L = torch.exp(_segsum(a))  # [b, h, c, l, s]
        CB = torch.einsum("bclgn,bcsgn->bcgls", C, B)  # [b, c, g, l, s]
        CB = CB.repeat_interleave(hpg, dim=2)  # [b, c, h, l, s]
        W = CB * L.permute(0, 2, 1, 3, 4)  # [b, c, h, l, s]
        y_diag = torch.einsum("bchls,bcshp->bclhp", W, xd)
        decay_states = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, l]
        Bh = B.repeat_interleave(hpg, dim=3)  # [b, c, l, h, n]
        Ch = C.repeat_interleave(hpg, dim=3)
        states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_states, xd)
        if initial_states is None:
            init = torch.zeros_like(states[:, :1])
        else:
            init = initial_states[:, None].float()
        states = torch.cat([init, states], dim=1)
        decay_chunk = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
        new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
        states, final_state = new_states[:, :-1], new_states[:, -1]
        y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, states, torch.exp(a_cum))
        y = (y_diag + y_off).reshape(b, c * l, h, p)[:, :t]
        if D is not None:
            y = y + D.float()[:, None] * x
    if return_final_states:
        return y, final_state
    return y


def check_fast_scan(device):
    """fast_chunk_scan == transformers' mamba2_chunk_scan (values and gradients)."""
    from transformers.models.mamba2 import modeling_mamba2 as mm

    ref_fn = ORIGINAL_SCAN
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for (b, t, h, p, g, n, q) in [(2, 50, 4, 8, 1, 16, 16), (1, 64, 6, 12, 2, 8, 16), (2, 37, 4, 8, 1, 8, 64)]:
        args = [torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen),
                -torch.rand(h, generator=gen) * 4 - 0.5, torch.randn(b, t, g, n, generator=gen),
                torch.randn(b, t, g, n, generator=gen)]
        D = torch.randn(h, generator=gen)
        dtb = torch.randn(h, generator=gen)
        init = torch.randn(b, h, p, n, generator=gen)
        outs = []
        for fn in (ref_fn, fast_chunk_scan):
            xs = [v.clone().to(device).requires_grad_(True) for v in args]
            y, s = fn(*xs, chunk_size=q, D=D.to(device), dt_bias=dtb.to(device), dt_softplus=True,
                      initial_states=init.to(device), return_final_states=True)
            (y.square().mean() + s.square().mean()).backward()
            outs.append([y.detach(), s.detach()] + [v.grad for v in xs])
        for r, f in zip(*outs):
            e = float((r - f).abs().max() / (r.abs().max() + 1e-6))
            worst = max(worst, e)
    return worst


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
def make_config(a, vocab):
    from transformers import Mamba2Config

    d_inner = a.expand * a.hidden
    assert d_inner % a.head_dim == 0
    return Mamba2Config(
        vocab_size=vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        expand=a.expand,
        head_dim=a.head_dim,
        num_heads=d_inner // a.head_dim,
        n_groups=1,
        state_size=a.state,
        conv_kernel=4,
        chunk_size=a.chunk,
        use_conv_bias=True,
        use_bias=False,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        initializer_range=0.02,
        rescale_prenorm_residual=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def param_bytes_f16(model):
    seen, n = set(), 0
    for p in model.parameters():  # parameters() yields tied tensors once
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n, 2 * n


@torch.no_grad()
def window_nll(model, ids, device, batch=16):
    """Mean NLL over all predicted positions of consecutive non-overlapping CTX windows (see docstring)."""
    wins = [ids[i:i + CTX] for i in range(0, len(ids), CTX)]
    wins = [w for w in wins if len(w) >= 2]
    total, count = 0.0, 0
    full = [w for w in wins if len(w) == CTX]
    rest = [w for w in wins if len(w) != CTX]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]
    for grp in groups:
        x = torch.tensor(grp, dtype=torch.long, device=device)
        logits = model(input_ids=x, use_cache=False).logits.double()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, x[:, 1:, None]).squeeze(-1)
        total += float(nll.sum())
        count += nll.numel()
    return total / count, count, len(wins)


@torch.no_grad()
def generate(model, prompt_ids, n, device, greedy=True, temperature=0.8, top_k=40, gen=None):
    ids = list(prompt_ids)
    for _ in range(n):
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
        if greedy:
            nxt = int(torch.argmax(logits))
        else:
            v, i = torch.topk(logits / temperature, top_k)
            probs = torch.softmax(v, -1).cpu()
            nxt = int(i[int(torch.multinomial(probs, 1, generator=gen))])
        ids.append(nxt)
    return ids[len(prompt_ids):]


# --------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=".corpus/fortunes.txt")
    ap.add_argument("--out", default="assets")
    ap.add_argument("--heldout-out", default="tests/data/heldout.txt")
    ap.add_argument("--max-seconds", type=float, default=330.0,
                    help="budget for the whole script (tokenizer, training, eval, saving, samples)")
    ap.add_argument("--reserve-seconds", type=float, default=40.0,
                    help="part of --max-seconds kept for the final eval, saving and samples")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps, CPU")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--epochs", type=float, default=20.0, help="epoch cap (the time budget may cut it)")
    ap.add_argument("--evals-per-epoch", type=float, default=2.0)
    ap.add_argument("--max-steps", type=int, default=0, help="hard cap on steps (0: none)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for training (default: f32 + TF32)")
    ap.add_argument("--no-tf32", action="store_true", help="no TF32 matmuls in training")
    ap.add_argument("--hf-scan", action="store_true", help="train with HF's own (slow) chunk scan")
    ap.add_argument("--size-limit", type=int, default=14_000_000, help="bytes allowed for the assets folder")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()

    if a.smoke:
        a.hidden, a.layers, a.head_dim, a.state, a.chunk = 64, 2, 32, 16, 64
        a.batch, a.warmup = 4, 5
        a.max_steps = a.max_steps or 12
        a.device = a.device or "cpu"
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    deadline = T0 + a.max_seconds - a.reserve_seconds

    import transformers
    import tokenizers
    import safetensors
    from transformers import Mamba2ForCausalLM
    from transformers.models.mamba2 import modeling_mamba2 as mm

    global ORIGINAL_SCAN
    ORIGINAL_SCAN = mm.mamba2_chunk_scan

    vers = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__}
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(f"versions {vers}  device {device} ({dev_name})  smoke={a.smoke}")

    random.seed(a.seed)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 only for the training steps (after the scan check)
    torch.backends.cudnn.allow_tf32 = False

    # ---- data ----
    if not os.path.exists(a.corpus):
        sys.exit(f"{a.corpus} missing: run `bash scripts/fetch_corpus.sh` first (needs Debian's apt)")
    cookies, corpus_bytes = read_cookies(a.corpus)
    train_c, val_c, test_c = split(cookies, a.seed)
    h_text, h_n = heldout_text(test_c)
    os.makedirs(os.path.dirname(a.heldout_out) or ".", exist_ok=True)
    with open(a.heldout_out, "w", encoding="utf-8", newline="\n") as f:
        f.write(h_text)
    log(f"corpus {corpus_bytes} bytes, {len(cookies)} cookies: train {len(train_c)}, val {len(val_c)}, "
        f"test {len(test_c)} (heldout.txt: first {h_n} test cookies, {len(h_text.encode())} bytes)")

    tok = train_tokenizer(train_c, a.vocab)
    vocab = tok.get_vocab_size()
    os.makedirs(a.out, exist_ok=True)
    from tokenizers import Tokenizer, processors
    # The saved tokenizer adds <|endoftext|> (the BOS of every cookie) when asked for special
    # tokens, so engines prompt the model the way it was trained; everything here encodes
    # without it (the same ids as before), exactly as the held-out definition says.
    saved = Tokenizer.from_str(tok.to_str())
    saved.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", 0)])
    saved.save(os.path.join(a.out, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer.json"))  # use exactly what was saved
    tok.post_processor = None
    train_ids = encode_stream(tok, train_c)
    val_ids = encode_stream(tok, val_c)
    heldout_ids = tok.encode(open(a.heldout_out, encoding="utf-8").read()).ids
    assert heldout_ids == encode_stream(tok, test_c[:h_n]), "stream encoding differs from one-string encoding"
    assert tok.decode(heldout_ids, skip_special_tokens=False) == h_text, "tokenizer does not round-trip"
    log(f"tokenizer: vocab {vocab}, train {len(train_ids)} tokens ({sum(map(len, train_c)) / len(train_ids):.2f} "
        f"chars/token), val {len(val_ids)}, heldout {len(heldout_ids)}")

    # ---- model ----
    cfg = make_config(a, vocab)
    torch.manual_seed(a.seed)
    model = Mamba2ForCausalLM(cfg).float()
    n_params, f16_bytes = param_bytes_f16(model)
    tok_bytes = os.path.getsize(os.path.join(a.out, "tokenizer.json"))
    log(f"model: hidden {a.hidden}, layers {a.layers}, heads {cfg.num_heads}x{a.head_dim}, state {a.state}, "
        f"{n_params} params -> f16 {f16_bytes / 1e6:.2f} MB (+ tokenizer {tok_bytes / 1e6:.2f} MB)")
    if f16_bytes + tok_bytes + 100_000 > a.size_limit:
        sys.exit(f"model too big for {a.size_limit} bytes")
    model.to(device)

    if not a.hf_scan:
        err = check_fast_scan(device)
        log(f"fast scan vs HF scan: worst relative error {err:.2e}")
        if err < 1e-4:
            mm.mamba2_chunk_scan = fast_chunk_scan
        else:
            log("fast scan disagrees with HF: training with HF's scan")
            a.hf_scan = True
    if device.type == "cuda" and not a.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")

    data = torch.tensor(train_ids, dtype=torch.long)
    rng = random.Random(a.seed + 1)
    wins_per_epoch = (len(train_ids) - 1) // CTX - 1
    steps_per_epoch = max(1, wins_per_epoch // a.batch)
    planned = max(1, int(a.epochs * steps_per_epoch))
    if a.max_steps:
        planned = min(planned, a.max_steps)
    warmup = min(a.warmup, max(1, planned // 5))
    eval_every = max(1, int(steps_per_epoch / a.evals_per_epoch))
    log(f"{steps_per_epoch} steps/epoch of {a.batch}x{CTX} tokens; planned {planned} steps, warmup {warmup}, "
        f"eval every {eval_every}")

    def lr_at(s):
        if s < warmup:
            return a.lr * (s + 1) / warmup
        frac = min(1.0, (s - warmup) / max(1, planned - warmup))
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    def batches():
        epoch = 0
        while True:
            off = rng.randrange(CTX)
            starts = list(range(off, len(train_ids) - CTX - 1, CTX))
            rng.shuffle(starts)
            for i in range(0, len(starts) - a.batch + 1, a.batch):
                idx = torch.tensor(starts[i:i + a.batch])
                yield epoch, data[idx[:, None] + torch.arange(CTX + 1)[None, :]]
            epoch += 1

    def val_loss():
        model.eval()
        v = window_nll(model, val_ids, device)[0]
        model.train()
        return v

    model.train()
    it = batches()
    step, t_train, calib_done = 0, time.time(), False
    best = (float("inf"), -1, None)
    history = []
    calib_at, calib_len = min(10, planned), 20
    t_calib = None
    recent = []
    while step < planned:
        if time.time() > deadline:
            log(f"time budget reached at step {step}")
            break
        epoch, xb = next(it)
        xb = xb.to(device, non_blocking=True)
        for gparam in opt.param_groups:
            gparam["lr"] = lr_at(step)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(input_ids=xb[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.detach())
        del recent[:-20]
        if step == calib_at:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if t_calib is not None and not calib_done and step == calib_at + calib_len:
            if device.type == "cuda":
                torch.cuda.synchronize()
            sec = (time.time() - t_calib) / calib_len
            t_e = time.time()
            v_now = val_loss()  # also times one validation pass
            t_eval = time.time() - t_e
            # steps that fit, counting one validation pass every eval_every steps, with 5% slack
            fit = step + int((deadline - time.time()) / (sec + t_eval / eval_every) * 0.95)
            log(f"timing: {1 / sec:.2f} steps/s ({a.batch * CTX / sec:.0f} tokens/s), validation pass "
                f"{t_eval:.2f}s (val {v_now:.4f}); {fit} steps fit the budget, epoch cap gives {planned}")
            if fit < planned:
                planned = fit
                warmup = min(warmup, max(1, planned // 5))
            calib_done = True
        if step % eval_every == 0 or step == planned:
            v = val_loss()
            el = time.time() - t_train
            history.append({"step": step, "epoch": round(step / steps_per_epoch, 2), "train_loss": float(loss),
                            "val_nll": v, "lr": lr_at(step - 1), "seconds": round(el, 1)})
            log(f"step {step}/{planned} ep {step / steps_per_epoch:.2f} loss {float(loss):.4f} val {v:.4f} "
                f"lr {lr_at(step - 1):.2e} {step / el:.2f} steps/s")
            if v < best[0]:
                best = (v, step, {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})
    train_seconds = time.time() - t_train
    final_train_loss = float(torch.stack(recent).mean()) if recent else float("nan")  # mean of the last 20 steps
    if best[2] is None:
        best = (val_loss(), step, {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})
    log(f"trained {step} steps in {train_seconds:.1f}s ({step / max(train_seconds, 1e-9):.2f} steps/s); "
        f"best val {best[0]:.4f} at step {best[1]}")

    # ---- save (f16) ----
    mm.mamba2_chunk_scan = ORIGINAL_SCAN
    model.load_state_dict(best[2])
    model.eval()
    m16 = copy.deepcopy(model).to("cpu").half()
    m16.save_pretrained(a.out, safe_serialization=True)
    del m16
    from safetensors import safe_open
    with safe_open(os.path.join(a.out, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in names}
    assert "lm_head.weight" not in names and dtypes == {"F16"}, (names, dtypes)

    # ---- evaluate exactly what was saved: f16 weights upcast to f32, f32 math (no TF32) ----
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ev = Mamba2ForCausalLM.from_pretrained(a.out, dtype=torch.float32).to(device).eval()
    assert all(p.dtype == torch.float32 for p in ev.parameters())
    h_nll, h_count, h_wins = window_nll(ev, heldout_ids, device)
    v_nll = window_nll(ev, val_ids, device)[0]
    log(f"held-out (f16 weights, f32 eval): nll {h_nll:.5f} ppl {math.exp(h_nll):.3f} over {h_count} predictions "
        f"in {h_wins} windows; val nll {v_nll:.5f}")

    # ---- samples ----
    samples = []
    gen = torch.Generator().manual_seed(a.seed)
    for prompt in ("The", "A computer", "Love is"):
        p_ids = [0] + tok.encode(prompt).ids
        g = generate(ev, p_ids, 60, device, greedy=True)
        samples.append({"kind": "greedy", "prompt": prompt, "prompt_ids": p_ids, "ids": g,
                        "text": prompt + tok.decode(g, skip_special_tokens=False)})
    for prompt in ("The", "Q:", "It is"):
        p_ids = [0] + tok.encode(prompt).ids
        g = generate(ev, p_ids, 60, device, greedy=False, gen=gen)
        samples.append({"kind": "sampled (temperature 0.8, top-k 40)", "prompt": prompt, "prompt_ids": p_ids,
                        "ids": g, "text": prompt + tok.decode(g, skip_special_tokens=False)})
    for s in samples:
        log(f"--- {s['kind']} ---\n{s['text']}\n")

    total = time.time() - T0
    info = {
        "model": "HF transformers Mamba2ForCausalLM, n_groups 1, tied embeddings, f16 weights",
        "seed": a.seed,
        "smoke": a.smoke,
        "hyperparameters": {k: v for k, v in vars(a).items() if k not in ("out", "heldout_out", "corpus")},
        "config": {"vocab_size": vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
                   "num_heads": cfg.num_heads, "head_dim": a.head_dim, "state_size": a.state,
                   "chunk_size": a.chunk, "expand": a.expand, "n_groups": 1},
        "parameters": n_params,
        "train_scan": "HF mamba2_chunk_scan" if a.hf_scan else "einsum SSD (scripts/train_tiny.py fast_chunk_scan)",
        "corpus": {
            "source": "Debian packages fortunes-min and fortunes (fortune-mod 1.99.1-7.3, bookworm), BSD licence",
            "command": "bash scripts/fetch_corpus.sh",
            "file": a.corpus,
            "bytes": corpus_bytes,
            "cookies": len(cookies),
        },
        "split": {"method": "random.Random(seed).shuffle of cookie indices; first 5% test, next 3% val, rest train",
                  "train_cookies": len(train_c), "val_cookies": len(val_c), "test_cookies": len(test_c),
                  "heldout_cookies": h_n, "train_tokens": len(train_ids), "val_tokens": len(val_ids)},
        "stream_format": "EOT + EOT.join(cookies) + EOT with EOT = '<|endoftext|>' (id 0)",
        "tokenizer": {"type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer add_prefix_space=False, "
                              "ByteLevel decoder, no normalizer, post-processor adding <|endoftext|> (id 0) as BOS when special tokens are requested",
                      "vocab_size": vocab, "special_tokens": {EOT: 0}},
        "training": {"steps": step, "planned_steps": planned, "warmup_steps": warmup,
                     "lr_schedule": "linear warmup, then cosine from lr to lr*min_lr_frac at planned_steps", "steps_per_epoch": steps_per_epoch,
                     "epochs": round(step / steps_per_epoch, 3), "train_seconds": round(train_seconds, 1),
                     "steps_per_second": round(step / max(train_seconds, 1e-9), 3),
                     "final_train_loss": final_train_loss, "best_val_step": best[1], "best_val_nll": best[0],
                     "history": history},
        "heldout": {
            "file": a.heldout_out,
            "bytes": len(h_text.encode("utf-8")),
            "tokens": len(heldout_ids),
            "ctx": CTX,
            "windows": h_wins,
            "predicted_positions": h_count,
            "definition": "tokenizer.encode(file text as one string).ids (no special tokens added); consecutive "
                          "non-overlapping windows of 256 ids, last shorter window kept if >= 2 ids; each window "
                          "from a zero state; mean NLL (natural log) over positions 1..len-1 of every window; "
                          "f16 weights upcast to f32, f32 compute",
            "heldout_nll": h_nll,
            "heldout_ppl": math.exp(h_nll),
        },
        "val_nll_f16": v_nll,
        "samples": samples,
        "versions": vers,
        "device": f"{device} ({dev_name})",
        "wall_seconds_total": round(total, 1),
    }
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
    for n in os.listdir(a.out):
        os.chmod(os.path.join(a.out, n), 0o644)
    sizes = {n: os.path.getsize(os.path.join(a.out, n)) for n in sorted(os.listdir(a.out))}
    log(f"wrote {a.out}: {sizes} total {sum(sizes.values())} bytes; heldout_nll {h_nll:.5f} "
        f"heldout_ppl {math.exp(h_nll):.3f}; total {total:.1f}s")
    assert sum(sizes.values()) <= 16_000_000


ORIGINAL_SCAN = None

if __name__ == "__main__":
    main()
