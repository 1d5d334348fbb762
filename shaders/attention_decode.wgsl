// Flash-decoding, first half: one token's queries against cache rows 0 ..= ctrl.kv_len
// (the token's own row, stored by kv_store). The rows in use are cut into at most NSEG
// segments of seg_len(len) keys (decode_segments.wgsl), so any length spreads over the grid;
// workgroup (x, y, l) takes segments x, x + X, … (X the grid's width: NSEG, or fewer where
// the host knows the rows in use fill fewer) of lane l for the R query heads g0 … g0+R of
// kv head y / NGC, so K and V are read once per R heads. It writes, per head h and segment
// s, the partial `part [H][NSEG][HD + 2]`: the unnormalized Σ p·v (HD values), then the
// max score m and the sum l of p = exp(score − m), for the segments that hold rows only
// (a workgroup past them has nothing to do). attention_combine merges the partials.
//
// The segment's keys go by in tiles of KT. Scores: invocation t owns key j0 + t % KT and
// reads its K row straight from the cache, CW values per load (eight with K16), against
// RPT of the R queries (rows t / KT, + RG, …; in workgroup memory, read alike by the
// invocations of a row group: broadcast reads). Softmax:
// P invocations per row reduce the tile's max and sum in workgroup memory. P·V:
// invocation t owns the CW-value column chunk t % NCH of every row for the keys
// ≡ t / NCH (mod KG), reading V rows whole across its neighbours; the KG key groups'
// sums meet once, at the end of the segment. No subgroup operations; the R per-row
// values are straight-line variables (`#for`), not arrays, so they stay in registers.
// (Decode used to run on prefill's tile, attn_tile.wgsl, which stages K and V through 16
// KiB of workgroup memory 16 keys at a time: at 32k tokens of context the H200 spent
// 0.12 ms per layer in its barriers and its two workgroup-memory reads per multiply-add.)
//
// Constants: WG, HD, CW (4 or 2), NCH = HD / CW, R, NGC, G, H, HKV, KT (dividing WG), RG =
// WG / KT, RPT = ceil(R / RG), KG = WG / NCH, P (a power of two ≤ WG / R), KU (K loads in flight, dividing the row's loads), VU
// (V loads in flight), SEGK, NSEG, CTX, SCALE, QKV_LS, PART_LS.
// Flags: KV_F32 (f32 caches, else f16 pairs in u32), CW4 (HD a multiple of 4), K16 (f16
// keys eight per load).

#if CW4
alias CV = vec4<f32>;
#else
alias CV = vec2<f32>;
#endif
// A chunk of CW cache values as stored: f32s, or f16 pairs in u32s.
#if KV_F32
alias CR = CV;
#else
#if CW4
alias CR = vec2<u32>;
#else
alias CR = u32;
#endif
#endif
// K as loaded, KL loads per row: chunks, or with K16 eight f16 values per load (HD a
// multiple of 8): each invocation walks its own row, so the wider load halves the
// requests that do not coalesce.
#if K16
alias KR = vec4<u32>;
const KL: u32 = HD / 8u;
#else
alias KR = CR;
const KL: u32 = NCH;
#endif

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<KR>;
@group(0) @binding(2) var<storage, read> v_cache: array<CR>;
@group(0) @binding(3) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

const PS: u32 = HD + 2u;
// The −∞ of masked scores and empty partials (finite: -inf is not a WGSL literal).
const NEG: f32 = -3.0e38;

// Queries (pre-scaled), then, after the last tile, the key groups' sums of P·V.
var<workgroup> qs: array<CV, R * NCH>;
var<workgroup> ps: array<f32, R * KT>;
var<workgroup> red: array<f32, WG>;
var<workgroup> red_sum: array<f32, WG>;
var<workgroup> row_m: array<f32, R>;
var<workgroup> row_l: array<f32, R>;
var<workgroup> row_a: array<f32, R>;

// A chunk as f32.
fn as_cv(w: CR) -> CV {
#if KV_F32
    return w;
#else
#if CW4
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
#else
    return unpack2x16float(w);
#endif
#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // The lane's segments with rows (attention_combine reads only those): wid.x, wid.x +
    // nwg.x, … The host sizes the grid's x to the segments the rows in use fill, and any
    // narrower grid still covers them.
    let l = wid.z;
    let len = min(ctrl[l].kv_len + 1u, CTX);
    let seg = seg_len(len);
    let segs = live_segments(len, seg);
    for (var s = wid.x; s < segs; s += nwg.x) {
        segment(s, l, wid.y / NGC, (wid.y % NGC) * R, lid, len, seg);
        // (The next segment's queries overwrite qs, which the last writes read.)
        workgroupBarrier();
    }
}

// Segment s (keys s·seg … of the len in use) of lane l for the query heads g0 … g0+R of
// kv head kvh. Call from uniform control flow.
fn segment(s: u32, l: u32, kvh: u32, g0: u32, lid: u32, len: u32, seg: u32) {
    let k0 = s * seg;
    let k1 = min(k0 + seg, len);
    // The softmax's share: row sr, keys ≡ sq (mod P).
    let sr = lid / P;
    let sq = lid % P;
    let soft = lid < R * P;
    // The scores' share: key kk of each tile for rows rg, rg + RG, … (their first values in
    // qs; a row past R reads row R − 1 and is not written).
    let kk = lid % KT;
    let rg = lid / KT;
#for r RPT
    let q{r} = min(rg + {r}u * RG, R - 1u) * NCH;
#endfor
    // The P·V share: chunk c of every row, keys ≡ kg (mod KG).
    let c = lid % NCH;
    let kg = lid / NCH;
    let pv = kg < KG;
#for r R
    var o{r} = CV(0.0);
#endfor
    for (var j0 = k0; j0 < k1; j0 += KT) {
        // Key j0 + lid: the first KU of its row's loads go out before anything waits, so
        // the queries' loads (first tile) and the previous tile's barrier overlap them.
        let live = j0 + kk < k1;
        let kb = ((l * CTX + j0 + kk) * HKV + kvh) * KL;
#for u KU
        var w{u} = KR();
        if (live) {
            w{u} = k_cache[kb + {u}u];
        }
#endfor
        if (j0 == k0) {
            // Row r is head kvh·G + g0 + r (zero past the group's heads: their scores are
            // 0 and never written out).
            for (var i = lid; i < R * NCH; i += WG) {
                let r = i / NCH;
                var x = CV(0.0);
                if (g0 + r < G) {
                    let at = l * QKV_LS + (kvh * G + g0 + r) * HD + (i % NCH) * CW;
#if CW4
                    x = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]) * SCALE;
#else
                    x = vec2<f32>(qkv[at], qkv[at + 1u]) * SCALE;
#endif
                }
                qs[i] = x;
            }
            if (lid < R) {
                row_m[lid] = NEG;
                row_l[lid] = 0.0;
            }
        }
        // The queries are in; the previous tile's P·V is done with ps.
        workgroupBarrier();
#for r RPT
        var s{r} = 0.0;
#endfor
        for (var cc = 0u; cc < KL; cc += KU) {
            if (cc > 0u && live) {
#for u KU
                w{u} = k_cache[kb + cc + {u}u];
#endfor
            }
#for u KU
#if K16
            let ka{u} = vec4<f32>(unpack2x16float(w{u}.x), unpack2x16float(w{u}.y));
            let kc{u} = vec4<f32>(unpack2x16float(w{u}.z), unpack2x16float(w{u}.w));
#for r RPT
            s{r} += dot(qs[q{r} + 2u * (cc + {u}u)], ka{u}) + dot(qs[q{r} + 2u * (cc + {u}u) + 1u], kc{u});
#endfor
#else
            let k{u} = as_cv(w{u});
#for r RPT
            s{r} += dot(qs[q{r} + cc + {u}u], k{u});
#endfor
#endif
#endfor
        }
#for r RPT
        if (rg + {r}u * RG < R) {
            ps[(rg + {r}u * RG) * KT + kk] = select(NEG, s{r}, live);
        }
#endfor
        workgroupBarrier();
        // The tile's max per row: P partial maxima, each read by the row's P.
        var mx = NEG;
        if (soft) {
            for (var j = sq; j < KT; j += P) {
                mx = max(mx, ps[sr * KT + j]);
            }
        }
        red[lid] = mx;
        workgroupBarrier();
        // p = exp(score − new max), and P partial sums per row.
        var m_old = NEG;
        var m_new = NEG;
        var sum = 0.0;
        if (soft) {
            m_old = row_m[sr];
            m_new = m_old;
            for (var i = 0u; i < P; i++) {
                m_new = max(m_new, red[sr * P + i]);
            }
            for (var j = sq; j < KT; j += P) {
                let p = exp(ps[sr * KT + j] - m_new);
                ps[sr * KT + j] = p;
                sum += p;
            }
        }
        red_sum[lid] = sum;
        workgroupBarrier();
        if (soft && sq == 0u) {
            var tot = 0.0;
            for (var i = 0u; i < P; i++) {
                tot += red_sum[lid + i];
            }
            let a = exp(m_old - m_new);
            row_a[sr] = a;
            row_m[sr] = m_new;
            row_l[sr] = row_l[sr] * a + tot;
        }
        workgroupBarrier();
        if (pv) {
#for r R
            o{r} *= row_a[{r}u];
#endfor
            // VU keys' loads at a time (a key past the tile loads nothing and adds 0).
            let nk = min(KT, k1 - j0);
            for (var jb = kg; jb < nk; jb += VU * KG) {
#for u VU
                let jj{u} = jb + {u}u * KG;
                var v{u} = CV(0.0);
                if (jj{u} < nk) {
                    v{u} = as_cv(v_cache[((l * CTX + j0 + jj{u}) * HKV + kvh) * NCH + c]);
                }
                let pj{u} = min(jj{u}, KT - 1u);
#endfor
#for u VU
#for r R
                o{r} += ps[{r}u * KT + pj{u}] * v{u};
#endfor
#endfor
            }
        }
    }
    // The key groups' sums, one group after the other, into qs.
    for (var g = 0u; g < KG; g++) {
        if (kg == g) {
#for r R
            if (g == 0u) {
                qs[{r}u * NCH + c] = o{r};
            } else {
                qs[{r}u * NCH + c] += o{r};
            }
#endfor
        }
        workgroupBarrier();
    }
    for (var i = lid; i < R * HD; i += WG) {
        let r = i / HD;
        let d = i % HD;
        if (g0 + r < G) {
            part[l * PART_LS + ((kvh * G + g0 + r) * NSEG + s) * PS + d] = qs[r * NCH + d / CW][d % CW];
        }
    }
    if (lid < R && g0 + lid < G) {
        let at = l * PART_LS + ((kvh * G + g0 + lid) * NSEG + s) * PS;
        part[at + HD] = row_m[lid];
        part[at + HD + 1u] = row_l[lid];
    }
}
