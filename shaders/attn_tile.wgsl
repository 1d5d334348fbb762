// The attention tile shared by attention_decode and attention_prefill: R query rows of one
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
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
#endif

// Rows in workgroup memory are padded by one value: key j and query r start in different
// banks, so the R×KT dot products read without conflicts.
const QP: u32 = HD + 1u;
// The -∞ of masked scores and empty partials (finite: -inf is not a WGSL literal).
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, R * QP>;
var<workgroup> kvs: array<f32, KT * QP>;
var<workgroup> ps: array<f32, R * KT>;
var<workgroup> row_m: array<f32, R>;
var<workgroup> row_l: array<f32, R>;
var<workgroup> row_a: array<f32, R>;
var<workgroup> row_lim: array<u32, R>;

// Keys (or values) [j0, j0 + KT) of kv head `kvh` into kvs as f32, zero from `end` on.
fn load_tile(is_k: bool, kvh: u32, j0: u32, end: u32, lid: u32) {
#if KV_F32
    for (var i = lid; i < KT * HD; i += WG) {
        let j = i / HD;
        let d = i % HD;
        var x = 0.0;
        if (j0 + j < end) {
            let at = ((j0 + j) * HKV + kvh) * HD + d;
            if (is_k) {
                x = k_cache[at];
            } else {
                x = v_cache[at];
            }
        }
        kvs[j * QP + d] = x;
    }
#else
    let hw = HD / 2u;
    for (var i = lid; i < KT * hw; i += WG) {
        let j = i / hw;
        let c = i % hw;
        var x = vec2<f32>(0.0);
        if (j0 + j < end) {
            let at = ((j0 + j) * HKV + kvh) * hw + c;
            var w = 0u;
            if (is_k) {
                w = k_cache[at];
            } else {
                w = v_cache[at];
            }
            x = unpack2x16float(w);
        }
        kvs[j * QP + 2u * c] = x.x;
        kvs[j * QP + 2u * c + 1u] = x.y;
    }
#endif
}

// The rows' attention over keys [k_begin, k_end) of kv head `kvh` (k_begin < k_end, and
// every row sees at least its first key). Returns this invocation's unnormalized outputs:
// acc[i] is element (lid + i·WG) of the R×HD rows; row_m and row_l hold each row's
// running max and sum. The caller fills qs and row_lim and barriers first; every
// invocation must call it (uniform control flow).
fn attend_rows(kvh: u32, k_begin: u32, k_end: u32, lid: u32) -> array<f32, NO> {
    var acc: array<f32, NO>;
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
                var dot = 0.0;
                for (var d = 0u; d < HD; d++) {
                    dot += qs[r * QP + d] * kvs[j * QP + d];
                }
                s = dot;
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
        for (var o = 0u; o < NO; o++) {
            let i = lid + o * WG;
            if (i < R * HD) {
                let r = i / HD;
                let d = i % HD;
                var x = acc[o] * row_a[r];
                for (var j = 0u; j < KT; j++) {
                    x += ps[r * KT + j] * kvs[j * QP + d];
                }
                acc[o] = x;
            }
        }
        workgroupBarrier();
    }
    return acc;
}
