// Chunked SSD, step 2: CB[c,g,i,j] = C_i·B_j per chunk and group, for j ≤ i (the causal
// half; 64×64 tiles above the diagonal are skipped). Shared by the group's heads. Reads
// the conv output `u` (rows of CD = [x | B | C]).

@group(0) @binding(0) var<storage, read> u: array<f32>;
@group(0) @binding(1) var<storage, read_write> cb: array<f32>;
@group(0) @binding(2) var<storage, read> ctrl: Ctrl;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let ib = wid.x;
    let jb = wid.y;
    let c = wid.z / G;
    let g = wid.z % G;
    let tokens = ctrl.prompt_len;
    if (jb > ib || c * Q >= tokens) {
        return;
    }
    let bofs = DI + g * N;
    let cofs = DI + G * N + g * N;
    var acc: Tile;
    for (var n0 = 0u; n0 < N; n0 += 16u) {
        // C and B rows are contiguous along n: 16 neighbours walk n.
        for (var e = lid; e < 1024u; e += 256u) {
            let kk = e % 16u;
            let r = e / 16u;
            let ti = c * Q + ib * 64u + r;
            let tj = c * Q + jb * 64u + r;
            let n = n0 + kk;
            var cv = 0.0;
            var bv = 0.0;
            if (n < N && ib * 64u + r < Q && ti < tokens) {
                cv = u[ti * CD + cofs + n];
            }
            if (n < N && jb * 64u + r < Q && tj < tokens) {
                bv = u[tj * CD + bofs + n];
            }
            tile_put(kk, r, cv, bv);
        }
        tile_step(&acc, lid);
    }
    let i0 = ib * 64u + (lid / 16u) * 4u;
    let j0 = jb * 64u + (lid % 16u) * 4u;
    for (var r = 0u; r < 4u; r++) {
        for (var s = 0u; s < 4u; s++) {
            if (i0 + r < Q && j0 + s < Q) {
                cb[((c * G + g) * Q + i0 + r) * Q + j0 + s] = tile_row(acc, r)[s];
            }
        }
    }
}
