// Greedy sampling on the device: ctrl.token = argmax(logits) (lowest id on ties; NaN never
// wins), unless a stop token was already sampled. Marks `stopped` when the new token is a
// stop token. One workgroup.

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> ctrl: Ctrl;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var bv = -3.4e38;
    var bi = 0xffffffffu;
    for (var k = lid; k < V; k += WG) {
        let v = logits[k];
        if (v > bv || (bi == 0xffffffffu && v == bv)) {
            bv = v;
            bi = k;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    var stride = 1u;
    while (stride * 2u < WG) {
        stride *= 2u;
    }
    for (; stride > 0u; stride /= 2u) {
        if (lid < stride && lid + stride < WG) {
            let ov = best_v[lid + stride];
            let oi = best_i[lid + stride];
            if (ov > best_v[lid] || (ov == best_v[lid] && oi < best_i[lid])) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var t = best_i[0];
        if (t == 0xffffffffu) {
            t = 0u;
        }
        emit_token(t);
    }
}
