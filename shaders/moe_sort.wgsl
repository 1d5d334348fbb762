// Sorts a prefill block's (token, choice) pairs by expert for the grouped expert GEMMs: one
// workgroup counts each expert's pairs (ids [T, K] from moe_route, T = ctrl.prompt_len),
// gives each expert a segment of rows padded to whole tiles of TT, and scatters the pairs
// into it. Out: pairs[r] = t·K + k of sorted row r (NONE for padding), pos[t·K + k] = its row,
// tile_expert[i] = the expert of row tile i (NONE past the used rows). Rows within a
// segment come in any order: each row is computed on its own, and moe_combine sums a
// token's choices by pos in choice order.

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> ctrl: Ctrl;
@group(0) @binding(2) var<storage, read_write> pairs: array<u32>;
@group(0) @binding(3) var<storage, read_write> pos: array<u32>;
@group(0) @binding(4) var<storage, read_write> tile_expert: array<u32>;

var<workgroup> cnt: array<atomic<u32>, E>;
var<workgroup> fill: array<atomic<u32>, E>;
var<workgroup> start: array<u32, E>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let n = min(ctrl.prompt_len, TMAX) * K;
    for (var e = lid; e < E; e += WG) {
        atomicStore(&cnt[e], 0u);
        atomicStore(&fill[e], 0u);
    }
    for (var r = lid; r < TR; r += WG) {
        pairs[r] = NONE;
    }
    for (var i = lid; i < TR / TT; i += WG) {
        tile_expert[i] = NONE;
    }
    storageBarrier();
    workgroupBarrier();
    for (var p = lid; p < n; p += WG) {
        atomicAdd(&cnt[min(ids[p], E - 1u)], 1u);
    }
    workgroupBarrier();
    if (lid == 0u) {
        var s = 0u;
        for (var e = 0u; e < E; e++) {
            start[e] = s;
            s += (atomicLoad(&cnt[e]) + TT - 1u) / TT * TT;
        }
    }
    workgroupBarrier();
    for (var e = lid; e < E; e += WG) {
        let tiles = (atomicLoad(&cnt[e]) + TT - 1u) / TT;
        for (var i = 0u; i < tiles; i++) {
            tile_expert[start[e] / TT + i] = e;
        }
    }
    for (var p = lid; p < n; p += WG) {
        let e = min(ids[p], E - 1u);
        let r = start[e] + atomicAdd(&fill[e], 1u);
        pairs[r] = p;
        pos[p] = r;
    }
}
