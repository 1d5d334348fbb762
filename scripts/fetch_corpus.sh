#!/usr/bin/env bash
# Fetch the training corpus for assets/ (the tiny Mamba2 model): Debian's fortune cookies.
#
#   bash scripts/fetch_corpus.sh          (from the repo root; needs apt-get, dpkg and python3)
#
# Downloads the Debian packages `fortunes-min` and `fortunes` (fortune-mod 1.99.1, BSD licence,
# see .corpus/root/usr/share/doc/fortunes/copyright) with `apt-get download`, unpacks them with
# `dpkg -x` into .corpus/root, and writes .corpus/fortunes.txt: every cookie of every data file in
# usr/share/games/fortunes (regular files only, no *.dat index, no *.u8 links; file names sorted),
# each cookie followed by a line holding a single `%`.
# Offensive cookies are excluded: they live in the separate package `fortunes-off`, which is not
# fetched (and any path containing /off/ is skipped as well).
# Cleaning, in this order: bytes decoded as UTF-8 (errors replaced), CR LF -> LF, backspace
# overstrike removed (`c\b` pairs dropped: `_\bx` -> `x`, `x\bx` -> `x`), other control characters
# except tab and newline dropped, leading blank lines and trailing whitespace of each cookie
# stripped, empty cookies dropped, exact duplicates dropped (first occurrence kept).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CORPUS="$ROOT/.corpus"
PKGS="fortunes-min fortunes"

run() { echo "+ $*"; "$@"; }

mkdir -p "$CORPUS/debs"
cd "$CORPUS/debs"
if ! ls fortunes-min_*.deb fortunes_*.deb >/dev/null 2>&1; then
    if ! run apt-get download $PKGS; then
        run apt-get update
        run apt-get download $PKGS
    fi
fi
rm -rf "$CORPUS/root"
for f in $(ls *.deb | LC_ALL=C sort); do
    run dpkg -x "$f" "$CORPUS/root"
    echo "  $(dpkg-deb -f "$f" Package) $(dpkg-deb -f "$f" Version) sha256 $(sha256sum "$f" | cut -d' ' -f1)"
done
cd "$ROOT"

run python3 - "$CORPUS/root/usr/share/games/fortunes" "$CORPUS/fortunes.txt" <<'EOF'
import os, re, sys
src, dst = sys.argv[1], sys.argv[2]
names = sorted(
    n for n in os.listdir(src)
    if not n.endswith(".dat") and not n.endswith(".u8")
    and os.path.isfile(os.path.join(src, n)) and not os.path.islink(os.path.join(src, n))
    and "/off/" not in os.path.join(src, n)
)
seen, cookies, per_file = set(), [], []
for n in names:
    text = open(os.path.join(src, n), "rb").read().decode("utf-8", errors="replace")
    text = text.replace("\r\n", "\n")
    text = re.sub(r"[^\n]\x08", "", text)  # overstrike: drop the struck character and the backspace
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    records, cur = [], []
    for line in text.split("\n"):
        if line == "%":
            records.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    records.append("\n".join(cur))
    kept = 0
    for r in records:
        r = r.lstrip("\n").rstrip()
        if not r or r in seen:
            continue
        seen.add(r)
        cookies.append(r)
        kept += 1
    per_file.append((n, kept))
with open(dst, "w", encoding="utf-8", newline="\n") as f:
    for c in cookies:
        f.write(c + "\n%\n")
print("files:", " ".join(f"{n}:{k}" for n, k in per_file))
print(f"cookies: {len(cookies)}")
EOF
echo "bytes: $(wc -c < "$CORPUS/fortunes.txt") $CORPUS/fortunes.txt"
echo "sha256: $(sha256sum "$CORPUS/fortunes.txt" | cut -d' ' -f1)"
