// Flash-decoding, first half (after attn_tile.wgsl): one token's queries against cache rows
// 0 ..= ctrl.kv_len (the token's own row, stored by kv_store). The rows in use are cut into
// at most NSEG segments of seg_len(len) keys (whole key tiles), so any length spreads over
// the grid; workgroup (s, y) takes segment s for GB query heads of kv head
// y / NGC, so K and V are read once per GB heads. It writes, per head h and segment s,
// the partial `part [H][NSEG][HD + 2]`: the unnormalized Σ p·v (HD values), then the max
// score m and the sum l of p = exp(score − m). A segment that starts past the length
// writes m = −∞ (finite), l = 0 and leaves. attention_combine merges the partials.

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

const PS: u32 = HD + 2u;

// Keys per segment for `len` rows in use: the rows over NSEG, rounded up to SEGK.
fn seg_len(len: u32) -> u32 {
    return SEGK * max(1u, (len + SEGK * NSEG - 1u) / (SEGK * NSEG));
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let s = wid.x;
    let l = wid.z;
    kv_slot = l;
    let kvh = wid.y / NGC;
    let g0 = (wid.y % NGC) * GB;
    let len = min(ctrl[l].kv_len + 1u, CTX);
    let seg = seg_len(len);
    let k0 = s * seg;
    if (k0 >= len) {
        if (lid < GB && g0 + lid < G) {
            let at = l * PART_LS + ((kvh * G + g0 + lid) * NSEG + s) * PS;
            part[at + HD] = NEG;
            part[at + HD + 1u] = 0.0;
        }
        return;
    }
    let k1 = min(k0 + seg, len);
    // Row r is head kvh·G + g0 + r (zero past the group's heads).
    for (var i = lid; i < R * HD; i += WG) {
        let r = i / HD;
        let d = i % HD;
        var x = 0.0;
        if (g0 + r < G) {
            x = qkv[l * QKV_LS + (kvh * G + g0 + r) * HD + d] * SCALE;
        }
        put_q(r, d, x);
    }
    if (lid < R) {
        row_lim[lid] = k1 - 1u;
    }
    workgroupBarrier();
    let acc = attend_rows(kvh, k0, k1, lid);
    for (var o = 0u; o < NOUT; o++) {
        let i = out_index(lid, o);
        let r = i / HD;
        if (i < R * HD && g0 + r < G) {
            part[l * PART_LS + ((kvh * G + g0 + r) * NSEG + s) * PS + i % HD] = acc[o];
        }
    }
    if (lid < R && g0 + lid < G) {
        let at = l * PART_LS + ((kvh * G + g0 + lid) * NSEG + s) * PS;
        part[at + HD] = row_m[lid];
        part[at + HD + 1u] = row_l[lid];
    }
}
