// Chunked SSD, step 3: the state each chunk adds, s_c[h,p,n] = Σ_j exp(Λ_last − Λ_j)·δ_j
// ·x_j[p]·B_j[n] over the chunk's positions (a [P×Q]·[Q×N] product per chunk and head,
// in 64×64 tiles).

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> lam: array<f32>;
@group(0) @binding(2) var<storage, read_write> cst: array<f32>;
@group(0) @binding(3) var<storage, read> ctrl: Ctrl;
@group(0) @binding(4) var<storage, read> u: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let pb = wid.x;
    let nb = wid.y;
    let c = wid.z / H;
    let h = wid.z % H;
    let tokens = ctrl.prompt_len;
    if (c * Q >= tokens) {
        return;
    }
    let g = h / (H / G);
    let lbase = (c * H + h) * Q;
    let last = lam[lbase + Q - 1u];
    let jmax = min(Q, tokens - c * Q);
    var acc: Tile;
    for (var j0 = 0u; j0 < jmax; j0 += 16u) {
        for (var e = lid; e < 1024u; e += 256u) {
            let kk = e / 64u;
            let r = e % 64u;
            let j = j0 + kk;
            let t = c * Q + j;
            let p = pb * 64u + r;
            let n = nb * 64u + r;
            var xv = 0.0;
            var bv = 0.0;
            if (j < jmax) {
                let wj = exp(min(last - lam[lbase + j], 0.0)) * mix[t * DIP + DI + CD + h];
                if (p < P) {
                    xv = wj * u[t * CD + h * P + p];
                }
                if (n < N) {
                    bv = u[t * CD + DI + g * N + n];
                }
            }
            tile_put(kk, r, xv, bv);
        }
        tile_step(&acc, lid);
    }
    let p0 = pb * 64u + (lid / 16u) * 4u;
    let n0 = nb * 64u + (lid % 16u) * 4u;
    for (var r = 0u; r < 4u; r++) {
        for (var s = 0u; s < 4u; s++) {
            if (p0 + r < P && n0 + s < N) {
                cst[((c * H + h) * P + p0 + r) * N + n0 + s] = tile_row(acc, r)[s];
            }
        }
    }
}
