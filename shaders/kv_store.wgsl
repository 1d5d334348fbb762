// Stores the k and v of token t (rows of `qkv [T][QS]` = [q (H·HD) | k (HKV·HD) |
// v (HKV·HD)]) at cache row ctrl.kv_len + t of `k_cache`, `v_cache` ([CTX][HKV][HD], f16
// two per u32 or f32 with KV_F32). T = 1, or ctrl.prompt_len with PREFILL (grid row y =
// token). With ROPE, q is rotated in place and k before it is stored (HF rotate_half:
// pair (i, i + HD/2) turns by pos·THETA^(−2i/HD), pos = kv_len + t). A stopped step
// (ctrl.stopped != 0) and rows ≥ CTX store nothing. Lanes (batched decode, grid z = lane
// l): rows of `qkv` from l·QKV_LS, the slot's cache rows from l·CTX, ctrl[l]. Invocation i of a token: the q pairs
// first (ROPE only: H·HD/2), then the k and the v words (HKV·HD/2 each: elements 2c, 2c+1).

@group(0) @binding(0) var<storage, read_write> qkv: array<f32>;
#if KV_F32
@group(0) @binding(1) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read_write> v_cache: array<f32>;
#else
@group(0) @binding(1) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read_write> v_cache: array<u32>;
#endif
@group(0) @binding(3) var<storage, read> ctrl: array<Ctrl>;

const HALF: u32 = HD / 2u;
const NKV: u32 = HKV * HALF;
#if ROPE
const NQ: u32 = H * HALF;
#else
const NQ: u32 = 0u;
#endif

#if ROPE
// (cos, sin) of pos·θ^(−2i/HD). The angle is formed in f32 as HF does; it is then reduced
// to [−π, π] with 2π = C1 + C2 (C1 = 201/32 has few bits, so k·C1 is exact), since sin and
// cos are only accurate near zero on GPUs.
fn rotation(pos: u32, i: u32) -> vec2<f32> {
    let inv = pow(THETA, -f32(2u * i) / f32(HD));
    let a = f32(pos) * inv;
    let k = round(a * 0.15915494309189535);
    let r = (a - k * 6.28125) - k * 1.9353071795864769e-3;
    return vec2<f32>(cos(r), sin(r));
}

// Element e of the head starting at `at`, rotated for `pos`.
fn rotated(at: u32, e: u32, pos: u32) -> f32 {
    if (e < HALF) {
        let cs = rotation(pos, e);
        return qkv[at + e] * cs.x - qkv[at + e + HALF] * cs.y;
    }
    let cs = rotation(pos, e - HALF);
    return qkv[at + e] * cs.x + qkv[at + e - HALF] * cs.y;
}
#endif

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let l = gid.z;
#if PREFILL
    let tokens = ctrl[0].prompt_len;
#else
    let tokens = 1u;
#endif
    let pos = ctrl[l].kv_len + t;
    if (ctrl[l].stopped != 0u || t >= tokens || pos >= CTX) {
        return;
    }
    let row = l * QKV_LS + t * QS;
    let i = gid.x;
#if ROPE
    if (i < NQ) {
        let at = row + (i / HALF) * HD + i % HALF;
        let cs = rotation(pos, i % HALF);
        let a = qkv[at];
        let b = qkv[at + HALF];
        qkv[at] = a * cs.x - b * cs.y;
        qkv[at + HALF] = b * cs.x + a * cs.y;
        return;
    }
#endif
    if (i >= NQ + 2u * NKV) {
        return;
    }
    var w = i - NQ;
    let is_v = w >= NKV;
    if (is_v) {
        w -= NKV;
    }
    let kvh = w / HALF;
    let c = w % HALF;
    var head = row + H * HD + kvh * HD;
    if (is_v) {
        head += HKV * HD;
    }
    var x = vec2<f32>(qkv[head + 2u * c], qkv[head + 2u * c + 1u]);
#if ROPE
    if (!is_v) {
        x = vec2<f32>(rotated(head, 2u * c, pos), rotated(head, 2u * c + 1u, pos));
    }
#endif
    let dst = (l * CTX + pos) * HKV + kvh;
#if KV_F32
    if (is_v) {
        v_cache[dst * HD + 2u * c] = x.x;
        v_cache[dst * HD + 2u * c + 1u] = x.y;
    } else {
        k_cache[dst * HD + 2u * c] = x.x;
        k_cache[dst * HD + 2u * c + 1u] = x.y;
    }
#else
    let packed = pack2x16float(x);
    if (is_v) {
        v_cache[dst * HALF + c] = packed;
    } else {
        k_cache[dst * HALF + c] = packed;
    }
#endif
}
