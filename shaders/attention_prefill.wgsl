// Causal attention for the T = ctrl.prompt_len tokens of a prefill block (after
// attn_tile.wgsl): token t (position ctrl.kv_len + t) attends to cache rows
// 0 ..= kv_len + t, all stored by kv_store first. Workgroup (x, y) takes tokens
// [y·QT, y·QT + QT) × GB query heads of kv head x / NGC (row r = token r / GB, head r % GB),
// walks the keys its last token sees in tiles, and writes `o [T][OS]` rows normalized
// (OS = ceil32(H·HD); the x = 0 workgroups zero the tail past H·HD).

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
@group(0) @binding(4) var<storage, read_write> o: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let tokens = ctrl.prompt_len;
    let t0 = wid.y * QT;
    if (t0 >= tokens) {
        return;
    }
    let kvh = wid.x / NGC;
    let g0 = (wid.x % NGC) * GB;
    let t_end = min(t0 + QT, tokens);
    let base = ctrl.kv_len;
    let k_end = min(base + t_end, CTX);
    // Rows past the block's tokens or the group's heads: zero queries that see the same
    // keys as the tile's last token (finite, never written).
    for (var i = lid; i < R * HD; i += WG) {
        let r = i / HD;
        let d = i % HD;
        let t = t0 + r / GB;
        let g = g0 + r % GB;
        var x = 0.0;
        if (t < t_end && g < G) {
            x = qkv[t * QS + (kvh * G + g) * HD + d] * SCALE;
        }
        put_q(r, d, x);
    }
    if (lid < R) {
        let t = min(t0 + lid / GB, t_end - 1u);
        row_lim[lid] = min(base + t, k_end - 1u);
    }
    workgroupBarrier();
    let acc = attend_rows(kvh, 0u, k_end, lid);
    for (var k = 0u; k < NOUT; k++) {
        let i = out_index(lid, k);
        let r = i / HD;
        let t = t0 + r / GB;
        let g = g0 + r % GB;
        if (i < R * HD && t < t_end && g < G) {
            o[t * OS + (kvh * G + g) * HD + i % HD] = acc[k] / row_l[r];
        }
    }
    if (wid.x == 0u) {
        let pad = max(OS - H * HD, 1u);
        for (var i = lid; i < (t_end - t0) * (OS - H * HD); i += WG) {
            o[(t0 + i / pad) * OS + H * HD + i % pad] = 0.0;
        }
    }
}
