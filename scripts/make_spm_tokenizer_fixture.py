#!/usr/bin/env python3
"""The SentencePiece (`tokenizer.ggml.model = "llama"`) tokenizer fixture of tests/gguf_tokenizer.rs:
a tiny SentencePiece BPE model trained here, written as GGUF metadata the way llama.cpp's
converter writes one (`convert_hf_to_gguf.py`, `_create_vocab_sentencepiece`: pieces,
scores, token types 1 normal / 2 unknown / 3 control / 6 byte, then bos/eos/unk ids), and
the ids SentencePiece itself gives a set of texts: the oracle the engine's rebuilt
tokenizer is held to.

  python3 -m venv /tmp/spm && /tmp/spm/bin/pip install gguf sentencepiece protobuf numpy
  /tmp/spm/bin/python scripts/make_spm_tokenizer_fixture.py --out tests/fixtures/gguf

(gguf 0.19.0, sentencepiece 0.2.3, protobuf 7.36.2 were used.)

The model is trained with `normalization_rule_name=identity` and
`remove_extra_whitespaces=false`, because llama.cpp's SPM tokenizer applies neither NFKC
nor whitespace collapsing: it only replaces spaces with `▁` and, when
`tokenizer.ggml.add_space_prefix` holds (true when absent), puts one `▁` in front. With
those options SentencePiece's own encoder does the same, so its ids are what llama.cpp
gives. The `add_dummy_prefix = false` expectations come from the same model with only
that normalizer flag turned off.

Made:
- `spm.gguf`: the vocabulary without `add_space_prefix` (the default: a prefix), with
  `add_bos_token = true`.
- `spm.no_space_prefix.gguf`: the same vocabulary with `add_space_prefix = false` and
  `add_bos_token = false`.
- `spm.tokens.json`: per text, SentencePiece's ids with and without the dummy prefix
  (without BOS: the test adds it where the file asks for it, as llama.cpp does).

Each GGUF holds one 1-value F32 tensor `dummy`: the reader refuses a file without tensors.
"""

import argparse
import io
import json
import os

import numpy as np
import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

CORPUS = """The quick brown fox jumps over the lazy dog.
A state space model reads a sequence one token at a time and keeps a fixed state.
Hello world, hello there, hello again: the world says hello back.
Tokenizers split text into pieces; the pieces become ids, and ids become text again.
Numbers like 12, 345 and 6789 appear in text as often as words do.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
To be or not to be, that is the question the model answers one token at a time.
Peter Piper picked a peck of pickled peppers; where is the peck Peter Piper picked?
""" * 4

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    " leading space",
    "two  spaces and trailing ",
    "a state space model",
    "Numbers: 2024, 1234567.",
    # Characters the model never saw: byte fallback (<0xNN> pieces).
    "naïve café ☃ 🦀",
    "line one\nline two\ttab",
    "pickled peppers!",
]


def train() -> bytes:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=out,
        model_type="bpe",
        vocab_size=480,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=False,
        hard_vocab_limit=False,
        num_threads=1,
        seed_sentencepiece_size=1000,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
    )
    return out.getvalue()


def processor(proto: bytes, dummy_prefix: bool) -> spm.SentencePieceProcessor:
    m = model_pb2.ModelProto()
    m.ParseFromString(proto)
    m.normalizer_spec.add_dummy_prefix = dummy_prefix
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def write_gguf(path: str, sp: spm.SentencePieceProcessor, space_prefix, add_bos: bool):
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        if sp.IsUnknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.IsControl(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.IsUnused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.IsByte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(add_bos)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/gguf")
    args = ap.parse_args()
    proto = train()
    with_prefix = processor(proto, True)
    without = processor(proto, False)
    assert [with_prefix.IdToPiece(i) for i in range(with_prefix.vocab_size())] == [
        without.IdToPiece(i) for i in range(without.vocab_size())
    ]
    write_gguf(os.path.join(args.out, "spm.gguf"), with_prefix, None, True)
    write_gguf(
        os.path.join(args.out, "spm.no_space_prefix.gguf"), without, False, False
    )
    cases = []
    for text in TEXTS:
        a, b = with_prefix.encode(text), without.encode(text)
        cases.append(
            {
                "text": text,
                "space_prefix": a,
                "space_prefix_pieces": [with_prefix.IdToPiece(i) for i in a],
                "no_space_prefix": b,
                "no_space_prefix_pieces": [without.IdToPiece(i) for i in b],
            }
        )
        # SentencePiece gives the text back (identity normalization, no collapsing).
        assert with_prefix.decode(a) == text and without.decode(b) == text, text
    doc = {
        "made_by": "scripts/make_spm_tokenizer_fixture.py (sentencepiece "
        + spm.__version__
        + ")",
        "bos": with_prefix.bos_id(),
        "vocab_size": with_prefix.vocab_size(),
        "cases": cases,
    }
    # One case a line: readable diffs when the fixture is remade.
    head = json.dumps({k: v for k, v in doc.items() if k != "cases"}, ensure_ascii=False)
    lines = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in cases)
    with open(os.path.join(args.out, "spm.tokens.json"), "w") as f:
        f.write(head[:-1] + ', "cases": [\n  ' + lines + "\n]}\n")


if __name__ == "__main__":
    main()
