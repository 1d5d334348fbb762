// Chunked SSD, step 1: per chunk c and head h, the inclusive cumsum Λ[c,h,i] of δ·A over
// the chunk's positions (past the block's end δ counts as 0, so Λ stays at its last
// value). `mix` rows of DIP = [z | x B C | δ]; T = ctrl.prompt_len.
// A workgroup takes 32 heads of one chunk (neighbouring invocations read neighbouring δ)
// and splits the Q positions into 8 segments: each invocation sums its segment, the
// segment totals are shared, then each writes its segment's running sums from the
// totals before it (one pass over Q/8 positions per invocation instead of Q in a chain).

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> lam: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;

const SEGS: u32 = 8u;
const SL: u32 = (Q + SEGS - 1u) / SEGS;

var<workgroup> totals: array<array<f32, 32>, SEGS>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let hl = lid % 32u;
    let seg = lid / 32u;
    let h = wid.x * 32u + hl;
    let c = wid.y;
    let tokens = ctrl.prompt_len;
    if (c * Q >= tokens) {
        return;
    }
    let live = h < H;
    let a = select(0.0, params[A_OFF + min(h, H - 1u)], live);
    let i0 = seg * SL;
    let i1 = min(Q, i0 + SL);
    // This segment's total.
    var sum = 0.0;
    for (var i = i0; i < i1; i++) {
        let t = c * Q + i;
        if (live && t < tokens) {
            sum += mix[t * DIP + DI + CD + h] * a;
        }
    }
    totals[seg][hl] = sum;
    workgroupBarrier();
    var acc = 0.0;
    for (var s = 0u; s < seg; s++) {
        acc += totals[s][hl];
    }
    if (!live) {
        return;
    }
    for (var i = i0; i < i1; i++) {
        let t = c * Q + i;
        if (t < tokens) {
            acc += mix[t * DIP + DI + CD + h] * a;
        }
        lam[(c * H + h) * Q + i] = acc;
    }
}
