// The attention tile of attention_prefill: R query rows of one
// kv head (pre-scaled queries in `qs`, row r sees keys ≤ row_lim[r]) against keys
// [k_begin, k_end) in tiles of KT keys, with an online softmax. Each tile: K to workgroup
// memory (coalesced, f16 → f32) → the R×KT scores → per-row running max / sum and the
// probabilities → V over K's place → every invocation's NO accumulators rescaled and
// added to. Nothing of size R×len ever leaves the workgroup. No subgroup operations.
// Constants: WG, HD, HKV, R, KT, NO = ceil(R·HD / WG). Flag KV_F32: f32 caches.

#if KV_F32
@group(0) @binding(1) var<storage, read> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read> v_cache: array<f32>;
#else
#if KV_VEC
// f16 caches read 16 bytes (eight values) per load when HD is a multiple of 8: 4-byte
// loads left the H200 far from its bandwidth at long contexts.
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<u32>>;
#else
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
#endif
#endif

// The -∞ of masked scores and empty partials (finite: -inf is not a WGSL literal).
const NEG: f32 = -3.0e38;

#if VEC4
// HD a multiple of 4: rows as vec4s padded by one vec4, so a score is HD/4 independent
// 16-byte products (a quarter of the dependent chain of the scalar layout; measured on the
// H200, the scalar chain made decode attention latency-bound at long contexts).
const QP: u32 = HD / 4u + 1u;
var<workgroup> qs: array<vec4<f32>, R * QP>;
var<workgroup> kvs: array<vec4<f32>, KT * QP>;

fn put_q(r: u32, d: u32, x: f32) {
    qs[r * QP + d / 4u][d % 4u] = x;
}
fn put_kv(j: u32, d: u32, x: f32) {
    kvs[j * QP + d / 4u][d % 4u] = x;
}
fn get_kv(j: u32, d: u32) -> f32 {
    return kvs[j * QP + d / 4u][d % 4u];
}
fn score(r: u32, j: u32) -> f32 {
    var acc = vec4<f32>(0.0);
    for (var c = 0u; c < HD / 4u; c++) {
        acc += qs[r * QP + c] * kvs[j * QP + c];
    }
    return (acc.x + acc.y) + (acc.z + acc.w);
}

// Each invocation owns whole vec4s of the output rows: NO4 of them, four values each.
// (Measured on the H200: with one scalar output per row and key, the P·V loop was 40 % of
// the decode attention time at 32k tokens.)
const NO4: u32 = (R * HD / 4u + WG - 1u) / WG;
const NOUT: u32 = 4u * NO4;
// The element (row·HD + d) of this invocation's k-th output value.
fn out_index(lid: u32, k: u32) -> u32 {
    return (lid + (k / 4u) * WG) * 4u + k % 4u;
}
#else
// Rows in workgroup memory are padded by one value: key j and query r start in different
// banks, so the R×KT dot products read without conflicts.
const QP: u32 = HD + 1u;
var<workgroup> qs: array<f32, R * QP>;
var<workgroup> kvs: array<f32, KT * QP>;

fn put_q(r: u32, d: u32, x: f32) {
    qs[r * QP + d] = x;
}
fn put_kv(j: u32, d: u32, x: f32) {
    kvs[j * QP + d] = x;
}
fn get_kv(j: u32, d: u32) -> f32 {
    return kvs[j * QP + d];
}
fn score(r: u32, j: u32) -> f32 {
    var dot = 0.0;
    for (var d = 0u; d < HD; d++) {
        dot += qs[r * QP + d] * kvs[j * QP + d];
    }
    return dot;
}

const NOUT: u32 = NO;
// The element (row·HD + d) of this invocation's k-th output value.
fn out_index(lid: u32, k: u32) -> u32 {
    return lid + k * WG;
}
#endif
var<workgroup> ps: array<f32, R * KT>;
var<workgroup> row_m: array<f32, R>;
var<workgroup> row_l: array<f32, R>;
var<workgroup> row_a: array<f32, R>;
var<workgroup> row_lim: array<u32, R>;
// The sequence slot whose caches are read (rows CTX apart per slot; prefill reads slot 0).
var<private> kv_slot: u32;

// Keys (or values) [j0, j0 + KT) of kv head `kvh` into kvs as f32, zero from `end` on.
fn load_tile(is_k: bool, kvh: u32, j0: u32, end: u32, lid: u32) {
#if KV_F32
    for (var i = lid; i < KT * HD; i += WG) {
        let j = i / HD;
        let d = i % HD;
        var x = 0.0;
        if (j0 + j < end) {
            let at = ((kv_slot * CTX + j0 + j) * HKV + kvh) * HD + d;
            if (is_k) {
                x = k_cache[at];
            } else {
                x = v_cache[at];
            }
        }
        put_kv(j, d, x);
    }
#else
#if KV_VEC
    let hv = HD / 8u;
    for (var i = lid; i < KT * hv; i += WG) {
        let j = i / hv;
        let c = i % hv;
        var w = vec4<u32>(0u);
        if (j0 + j < end) {
            let at = ((kv_slot * CTX + j0 + j) * HKV + kvh) * hv + c;
            if (is_k) {
                w = k_cache[at];
            } else {
                w = v_cache[at];
            }
        }
        // KV_VEC implies VEC4 (HD a multiple of 8): two whole vec4s of the row.
        kvs[j * QP + 2u * c] = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
        kvs[j * QP + 2u * c + 1u] = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
    }
#else
    let hw = HD / 2u;
    for (var i = lid; i < KT * hw; i += WG) {
        let j = i / hw;
        let c = i % hw;
        var x = vec2<f32>(0.0);
        if (j0 + j < end) {
            let at = ((kv_slot * CTX + j0 + j) * HKV + kvh) * hw + c;
            var w = 0u;
            if (is_k) {
                w = k_cache[at];
            } else {
                w = v_cache[at];
            }
            x = unpack2x16float(w);
        }
        put_kv(j, 2u * c, x.x);
        put_kv(j, 2u * c + 1u, x.y);
    }
#endif
#endif
}

// The rows' attention over keys [k_begin, k_end) of kv head `kvh` (k_begin < k_end, and
// every row sees at least its first key). Returns this invocation's unnormalized outputs:
// acc[k] is element out_index(lid, k) of the R×HD rows; row_m and row_l hold each row's
// running max and sum. The caller fills qs and row_lim and barriers first; every
// invocation must call it (uniform control flow).
fn attend_rows(kvh: u32, k_begin: u32, k_end: u32, lid: u32) -> array<f32, NOUT> {
#if VEC4
    var acc4: array<vec4<f32>, NO4>;
#else
    var acc: array<f32, NO>;
#endif
    if (lid < R) {
        row_m[lid] = NEG;
        row_l[lid] = 0.0;
    }
    for (var j0 = k_begin; j0 < k_end; j0 += KT) {
        load_tile(true, kvh, j0, k_end, lid);
        workgroupBarrier();
        for (var i = lid; i < R * KT; i += WG) {
            let r = i / KT;
            let j = i % KT;
            var s = NEG;
            if (j0 + j <= row_lim[r] && j0 + j < k_end) {
                s = score(r, j);
            }
            ps[i] = s;
        }
        workgroupBarrier();
        // K is spent: V takes its place while R invocations update the softmax.
        if (lid < R) {
            let m0 = row_m[lid];
            var m = m0;
            for (var j = 0u; j < KT; j++) {
                m = max(m, ps[lid * KT + j]);
            }
            var sum = 0.0;
            for (var j = 0u; j < KT; j++) {
                let p = exp(ps[lid * KT + j] - m);
                ps[lid * KT + j] = p;
                sum += p;
            }
            let a = exp(m0 - m);
            row_m[lid] = m;
            row_l[lid] = row_l[lid] * a + sum;
            row_a[lid] = a;
        }
        load_tile(false, kvh, j0, k_end, lid);
        workgroupBarrier();
#if VEC4
        for (var o = 0u; o < NO4; o++) {
            let i4 = lid + o * WG;
            if (i4 < R * HD / 4u) {
                let r = i4 / (HD / 4u);
                let c = i4 % (HD / 4u);
                var x = acc4[o] * row_a[r];
                for (var j = 0u; j < KT; j++) {
                    x += ps[r * KT + j] * kvs[j * QP + c];
                }
                acc4[o] = x;
            }
        }
#else
        for (var o = 0u; o < NO; o++) {
            let i = lid + o * WG;
            if (i < R * HD) {
                let r = i / HD;
                let d = i % HD;
                var x = acc[o] * row_a[r];
                for (var j = 0u; j < KT; j++) {
                    x += ps[r * KT + j] * get_kv(j, d);
                }
                acc[o] = x;
            }
        }
#endif
        workgroupBarrier();
    }
#if VEC4
    var acc: array<f32, NOUT>;
    for (var o = 0u; o < NO4; o++) {
        acc[4u * o] = acc4[o].x;
        acc[4u * o + 1u] = acc4[o].y;
        acc[4u * o + 2u] = acc4[o].z;
        acc[4u * o + 3u] = acc4[o].w;
    }
#endif
    return acc;
}
