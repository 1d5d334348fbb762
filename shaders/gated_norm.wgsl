// The unfused graph's gated group RMSNorm: v = y ⊙ silu(z); each of the G contiguous
// groups of GS channels is divided by its own RMS, then ⊙ norm weight (RV = G sums). Each
// workgroup sums every group and writes its own CHUNK channels; with Q8_OUT also the q8
// blocks of the result.
// `mix` holds z in its first DI entries. Batched (prefill): workgroup row y handles token
// y (y rows of DI, mix rows of MIX, dst rows of KP).

// VEC4 (no q8 output; DI, GS and MIX multiples of 4): each invocation takes four
// channels per 16-byte load (one channel per 4-byte load left Codestral's prefill norm at
// 20 ms for 4096 tokens on the H200, a fifth of the bandwidth).
#if VEC4
@group(0) @binding(0) var<storage, read> y: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> mix: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> dst: array<vec4<f32>>;
#else
@group(0) @binding(0) var<storage, read> y: array<f32>;
@group(0) @binding(1) var<storage, read> mix: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
#endif
@group(0) @binding(2) var<storage, read> params: array<f32>;
#if Q8_OUT
@group(0) @binding(4) var<storage, read_write> xq: array<u32>;
@group(0) @binding(5) var<storage, read_write> xd: array<f32>;
#endif

#if VEC4
// Channels 4·c4 .. +4 of token t.
fn gated4(t: u32, c4: u32) -> vec4<f32> {
    let z = mix[(t * MIX) / 4u + c4];
    return y[(t * DI) / 4u + c4] * (z / (1.0 + exp(-z)));
}

// Stores v, token t's gated channels 4·c4 .. +4, divided by their group's RMS (from the
// group sums `tot`) and times the norm weight.
fn put_scaled4(t: u32, c4: u32, v: vec4<f32>, tot: ptr<function, array<f32, RV>>) {
    let c = 4u * c4;
    let w = vec4<f32>(params[NW_OFF + c], params[NW_OFF + c + 1u], params[NW_OFF + c + 2u], params[NW_OFF + c + 3u]);
    dst[(t * KP) / 4u + c4] = v * inverseSqrt((*tot)[c / GS] / f32(GS) + EPS) * w;
}
#else
fn gated(t: u32, c: u32) -> f32 {
    return y[t * DI + c] * silu(mix[t * MIX + c]);
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
    var ss: array<f32, RV>;
#if REG
    // One workgroup per token (prefill): this invocation's PER vec4s of the token stay in
    // registers from the sum to the scaling, so y and z are read from memory once, not
    // twice. Same sums in the same order as the VEC4 loop below.
    var g: array<vec4<f32>, PER>;
    for (var i = 0u; i < PER; i++) {
        let c4 = lid + i * WG;
        if (c4 < DI / 4u) {
            g[i] = gated4(t, c4);
            ss[(4u * c4) / GS] += dot(g[i], g[i]);
        }
    }
    var tot = wg_sum(ss, lid, sg_lane, sg_size);
    for (var i = 0u; i < PER; i++) {
        let c4 = lid + i * WG;
        if (c4 < DI / 4u) {
            put_scaled4(t, c4, g[i], &tot);
        }
    }
#else
#if VEC4
    for (var c4 = lid; c4 < DI / 4u; c4 += WG) {
        let v = gated4(t, c4);
        ss[(4u * c4) / GS] += dot(v, v);
    }
    var tot = wg_sum(ss, lid, sg_lane, sg_size);
    for (var c4 = wid.x * WG + lid; c4 < DI / 4u; c4 += WG * nwg.x) {
        put_scaled4(t, c4, gated4(t, c4), &tot);
    }
#else
    for (var c = lid; c < DI; c += WG) {
        let v = gated(t, c);
        ss[c / GS] += v * v;
    }
    var tot = wg_sum(ss, lid, sg_lane, sg_size);
    // One channel per invocation per chunk of WG; a token's workgroups share its chunks
    // (one workgroup per token in prefill, many per token in decode).
    for (var first = wid.x * WG; first < DI; first += WG * nwg.x) {
        let c = first + lid;
        var v = 0.0;
        if (c < DI) {
            v = gated(t, c) * inverseSqrt(tot[c / GS] / f32(GS) + EPS) * params[NW_OFF + c];
            dst[t * KP + c] = v;
        }
#if Q8_OUT
        q8_chunk(v, lid, first, t * KP);
#endif
    }
#endif
#endif
}
