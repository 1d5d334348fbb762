// Chunked SSD, step 5: the outputs of a chunk, per head, in 64 (positions) × 64 (channels)
// tiles:  y_i[p] = exp(Λ_i)·Σ_n C_i[n]·S_c[p,n]                         (state entering c)
//                + Σ_{j≤i} CB[i,j]·exp(min(Λ_i − Λ_j, 0))·δ_j·x_j[p]    (within the chunk)
//                + D_h·x_i[p]
// Reads x, C from the conv output `u` (rows of CD) and δ from `mix`; writes y rows of DI.

@group(0) @binding(0) var<storage, read> mix: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> lam: array<f32>;
@group(0) @binding(3) var<storage, read> cb: array<f32>;
@group(0) @binding(4) var<storage, read> cst: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read> ctrl: Ctrl;
@group(0) @binding(7) var<storage, read> u: array<f32>;

const NIB: u32 = (Q + 63u) / 64u;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let ib = wid.x % NIB;
    let pb = wid.x / NIB;
    let h = wid.y;
    let c = wid.z;
    let tokens = ctrl.prompt_len;
    if (c * Q >= tokens) {
        return;
    }
    let g = h / (H / G);
    let lbase = (c * H + h) * Q;
    let imax = min(Q, tokens - c * Q);
    let cofs = DI + G * N + g * N;
    var acc: Tile;
    // Inter-chunk: C (positions × n) · S_cᵀ (n × channels).
    for (var n0 = 0u; n0 < N; n0 += 16u) {
        // C rows and S rows are contiguous along n: 16 neighbours walk n.
        for (var e = lid; e < 1024u; e += 256u) {
            let kk = e % 16u;
            let r = e / 16u;
            let n = n0 + kk;
            let i = ib * 64u + r;
            let p = pb * 64u + r;
            var cv = 0.0;
            var sv = 0.0;
            if (n < N && i < imax) {
                cv = u[(c * Q + i) * CD + cofs + n];
            }
            if (n < N && p < P) {
                sv = cst[((c * H + h) * P + p) * N + n];
            }
            tile_put(kk, r, cv, sv);
        }
        tile_step(&acc, lid);
    }
    let i0 = ib * 64u + (lid / 16u) * 4u;
    let li = vec4<u32>(min(i0, Q - 1u), min(i0 + 1u, Q - 1u), min(i0 + 2u, Q - 1u), min(i0 + 3u, Q - 1u));
    tile_scale(&acc, exp(vec4<f32>(lam[lbase + li.x], lam[lbase + li.y], lam[lbase + li.z], lam[lbase + li.w])));
    // Intra-chunk: M (positions × positions, causal) · X (positions × channels).
    let jend = min(ib * 64u + 64u, imax);
    for (var j0 = 0u; j0 < jend; j0 += 16u) {
        // CB rows are contiguous along j (16 neighbours walk j), x rows along channels
        // (64 neighbours walk p).
        for (var e = lid; e < 1024u; e += 256u) {
            let kk = e % 16u;
            let i = ib * 64u + e / 16u;
            let j = j0 + kk;
            var mv = 0.0;
            if (j < imax && i < imax && j <= i) {
                let dj = mix[(c * Q + j) * DIP + DI + CD + h];
                mv = cb[((c * G + g) * Q + i) * Q + j] * exp(min(lam[lbase + i] - lam[lbase + j], 0.0)) * dj;
            }
            tile_put_a(kk, e / 16u, mv);
            let jx = j0 + e / 64u;
            let p = pb * 64u + e % 64u;
            var xv = 0.0;
            if (jx < imax && p < P) {
                xv = u[(c * Q + jx) * CD + h * P + p];
            }
            tile_put_b(e / 64u, e % 64u, xv);
        }
        tile_step(&acc, lid);
    }
    let p0 = pb * 64u + (lid % 16u) * 4u;
    let dh = params[D_OFF + h];
    for (var r = 0u; r < 4u; r++) {
        let i = i0 + r;
        for (var s = 0u; s < 4u; s++) {
            let p = p0 + s;
            if (i < imax && p < P) {
                let t = c * Q + i;
                y[t * DI + h * P + p] = tile_row(acc, r)[s] + dh * u[t * CD + h * P + p];
            }
        }
    }
}
