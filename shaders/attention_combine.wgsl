// Flash-decoding, second half: merges the NSEG partials of attention_decode
// (`part [H][NSEG][HD + 2]`: Σ p·v, m, l) into `o [OS]` (OS = ceil32(H·HD), zero past
// H·HD) and, with Q8, the q8 blocks `xq [OS/4]`, `xd [OS/32]` of o for the o_proj GEMV.
// Workgroup b writes element block b (32 values); lane e of split k folds segments
// k, k + NSPLIT, … of its element with the running-max rescale, and the NSPLIT splits
// meet in workgroup memory. Only the segments that hold rows are read. Lanes (batched
// decode, workgroup z = lane l): partials from l·PART_LS, o and its q8 blocks from l·O_LS.

@group(0) @binding(0) var<storage, read> part: array<f32>;
@group(0) @binding(1) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(2) var<storage, read_write> o: array<f32>;
#if Q8
@group(0) @binding(3) var<storage, read_write> xq: array<u32>;
@group(0) @binding(4) var<storage, read_write> xd: array<f32>;
#endif

const PS: u32 = HD + 2u;
const NEG: f32 = -3.0e38;

var<workgroup> cm: array<f32, WG>;
var<workgroup> cl: array<f32, WG>;
var<workgroup> ca: array<f32, WG>;
var<workgroup> qv: array<f32, 32>;
var<workgroup> qinv: f32;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let blk = wid.x;
    let lane = wid.z;
    let e = lid % 32u;
    let split = lid / 32u;
    let ge = blk * 32u + e;
    let len = min(ctrl[lane].kv_len + 1u, CTX);
    // The segments attention_decode cut the rows into.
    let seg = seg_len(len);
    let live = live_segments(len, seg);
    var m = NEG;
    var l = 0.0;
    var a = 0.0;
    if (ge < H * HD) {
        let h = ge / HD;
        let d = ge % HD;
        for (var s = split; s < live; s += NSPLIT) {
            let at = lane * PART_LS + (h * NSEG + s) * PS;
            let ms = part[at + HD];
            let mn = max(m, ms);
            let x = exp(m - mn);
            let y = exp(ms - mn);
            l = l * x + part[at + HD + 1u] * y;
            a = a * x + part[at + d] * y;
            m = mn;
        }
    }
    cm[lid] = m;
    cl[lid] = l;
    ca[lid] = a;
    workgroupBarrier();
    if (split == 0u) {
        for (var k = 1u; k < NSPLIT; k++) {
            let ms = cm[k * 32u + e];
            let mn = max(m, ms);
            let x = exp(m - mn);
            let y = exp(ms - mn);
            l = l * x + cl[k * 32u + e] * y;
            a = a * x + ca[k * 32u + e] * y;
            m = mn;
        }
        var v = 0.0;
        if (ge < H * HD) {
            v = a / l;
        }
        o[lane * O_LS + ge] = v;
        qv[e] = v;
    }
#if Q8
    // d = amax/127, q = round(v/d) (ties to even), four int8 per u32: as q8_chunk.
    workgroupBarrier();
    if (lid == 0u) {
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(qv[i]));
        }
        let d = amax / 127.0;
        var inv = 0.0;
        if (d > 0.0) {
            inv = 1.0 / d;
        }
        qinv = inv;
        xd[lane * (O_LS / 32u) + blk] = d;
    }
    workgroupBarrier();
    if (lid < 8u) {
        let f = vec4<f32>(qv[4u * lid], qv[4u * lid + 1u], qv[4u * lid + 2u], qv[4u * lid + 3u]) * qinv;
        xq[lane * (O_LS / 4u) + blk * 8u + lid] = pack4xI8(clamp(vec4<i32>(round(f)), vec4<i32>(-127), vec4<i32>(127)));
    }
#endif
}
