// The MLP activation between its two projections, for T tokens (workgroup row y = token y):
// GATED 0: a = relu(u)², u the up projection's rows of I values;
// GATED 1: a = silu(g)·u from rows [g (I) | u (I)] of the fused gate+up projection.
// Rows of `src` have SS values; `dst` rows start DS apart and have KP (= I rounded up to
// 32) values, zero past I — what the down projection's GEMV/GEMM reads — and with Q8_OUT the q8 blocks of them.

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
#if Q8_OUT
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;
@group(0) @binding(3) var<storage, read_write> xd: array<f32>;
#endif
#if BIAS
// The layer's parameters: the up (or [gate | up]) biases at UB_OFF, the down bias (D
// values) at DB_OFF; the down bias goes into the residual here, before the down
// projection adds its product (each token's first workgroup writes its row).
@group(0) @binding(4) var<storage, read> params: array<f32>;
@group(0) @binding(5) var<storage, read_write> resid: array<f32>;
#endif

// Row value `k` of the up projection, with its bias.
fn up(sbase: u32, k: u32) -> f32 {
#if BIAS
    return src[sbase + k] + params[UB_OFF + k];
#else
    return src[sbase + k];
#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let t = wid.y;
    let sbase = t * SS;
    let dbase = t * DS;
#if BIAS
    if (wid.x == 0u) {
        for (var j = lid; j < D; j += WG) {
            resid[t * D + j] += params[DB_OFF + j];
        }
    }
#endif
    // Whole chunks of WG elements (so the q8 blocks of a chunk are complete), the row's
    // padding included: it is written as zeros.
    for (var first = wid.x * WG; first < KP; first += WG * nwg.x) {
        let k = first + lid;
        var a = 0.0;
        if (k < I) {
            if (GATED == 0u) {
                let r = max(up(sbase, k), 0.0);
                a = r * r;
            } else {
                a = silu(up(sbase, k)) * up(sbase, I + k);
            }
        }
        if (k < KP) {
            dst[dbase + k] = a;
        }
#if Q8_OUT
        q8_chunk(a, lid, first, dbase);
#endif
    }
}
