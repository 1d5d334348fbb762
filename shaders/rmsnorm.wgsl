// dst = src / rms(src) ⊙ params[NW_OFF..NW_OFF+D]: the block pre-norm and the final norm,
// writing the next GEMV's input once per token. With Q8_OUT also its q8 blocks (zero past
// D). Each workgroup sums all of src² (a few KB from cache) and writes its own CHUNK
// elements (CHUNK = WG), so the work spreads over the GPU instead of one multiprocessor.
// Batched (prefill): workgroup row y normalizes token y (src rows of D, dst rows of KP).

// VEC4 (prefill, no q8 output, D a multiple of 4): four values per 16-byte load.
#if VEC4
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;
#else
@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
#endif
@group(0) @binding(1) var<storage, read> params: array<f32>;
#if Q8_OUT
@group(0) @binding(3) var<storage, read_write> xq: array<u32>;
@group(0) @binding(4) var<storage, read_write> xd: array<f32>;
#endif

#if !VEC4
fn norm_x(i: u32) -> f32 {
    return src[i];
}
#endif

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUP
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
#if !SUBGROUP
    let sg_lane = 0u;
    let sg_size = 1u;
#endif
    let t = wid.y;
    let sbase = t * D;
    let dbase = t * KP;
#if VEC4
    var ss: array<f32, RV>;
    for (var k4 = lid; k4 < D / 4u; k4 += WG) {
        let v = src[sbase / 4u + k4];
        ss[0] += dot(v, v);
    }
    let tot = wg_sum(ss, lid, sg_lane, sg_size);
    let rstd = inverseSqrt(tot[0] / f32(D) + EPS);
    for (var k4 = wid.x * WG + lid; k4 < D / 4u; k4 += WG * nwg.x) {
        let k = 4u * k4;
        let w = vec4<f32>(params[NW_OFF + k], params[NW_OFF + k + 1u], params[NW_OFF + k + 2u], params[NW_OFF + k + 3u]);
        dst[dbase / 4u + k4] = src[sbase / 4u + k4] * rstd * w;
    }
#else
    // This invocation's element of the workgroup's first chunk and its norm weight go out
    // with the sum's loads (straight-line, SSL = ⌈D/WG⌉ of them, summed in the loop's
    // order): the kernel is one memory latency, not three.
    let k0 = wid.x * WG + lid;
    var x0 = 0.0;
    var w0 = 0.0;
    if (k0 < D) {
        x0 = src[sbase + k0];
        w0 = params[NW_OFF + k0];
    }
    let rstd = norm_rstd(sbase, lid, sg_lane, sg_size);
    // One element per invocation per chunk of WG; a token's workgroups share its chunks
    // (one workgroup per token in prefill, many per token in decode).
    for (var first = wid.x * WG; first < D; first += WG * nwg.x) {
        let k = first + lid;
        var v = 0.0;
        if (k < D) {
            var xv = x0;
            var wv = w0;
            if (first != wid.x * WG) {
                xv = src[sbase + k];
                wv = params[NW_OFF + k];
            }
            v = xv * rstd * wv;
            dst[dbase + k] = v;
        }
#if Q8_OUT
        q8_chunk(v, lid, first, dbase);
#endif
    }
#endif
}
