// y = W·x for one token (gemv_lanes.wgsl: for several, each weight read once): W [M, K]
// in f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k (rows zero-padded
// to KP columns; the 4/5/6-bit layouts and bindings are block_quant.wgsl's).
// A team of TEAM consecutive invocations owns a row and strides over it with 16-byte
// loads (all but f32: UNROLL of them issued together, then summed in order); R = WG/TEAM
// rows per workgroup; one team reduction per row. The input is ready:
// f32 `src [KP]` (zero past K) for f32/f16 weights, q8 blocks `xq`/`xd` (X_Q8) for the
// quantized ones (made once per token by the producer kernel, so no workgroup repeats that
// work), multiplied with dot4I8Packed: 4-bit quants are widened to bytes in registers
// (q4_0's offset of 8 by a sign flip, q4_1/q5_1's and the k-quants' mins by Σq_x of the block), q6_k's
// 6-bit ones as 4·(q−32).
// Flags: W_F32 | W_HALF (W_F16 | W_BF16) | W_Q8 | W_Q4_0 | W_Q4_1 | W_Q5 (W_Q5_0 | W_Q5_1) | W_K4 (W_Q4_K | W_Q5_K) | W_Q6_K;  X_GROUP (x_k is scaled by its group's rstd, from the SSD
// step's per-block Σv²: the gated group norm folded in) | X_NORM (f32 weights: x is the
// residual through the block's RMS pre-norm, made in the prologue; X_LOCAL, quantized
// weights: its q8 blocks in workgroup memory) | EARLY_F32 (f32 with the folded pre-norm:
// the lane's NVT weight vectors loaded before the prologue) | EARLY (q8_0 with the folded pre-norm:
// the first weights loaded before it);  O_STORE | O_ADD | O_MIXER; O_ARGMAX (with
// O_STORE, one token: each workgroup's best row for the greedy argmax); O_KV (with
// O_STORE, one token: the k and v rows also into the KV caches).

// The group-norm factor of input column k (1 without X_GROUP).
fn col_scale(k: u32) -> f32 {
#if X_GROUP
    return grp_rstd[k / GS];
#else
    return 1.0;
#endif
}

#if W_F32
// Input vector v (four columns) as the f32 products take it.
fn x_vec4(v: u32) -> vec4<f32> {
#if X_NORM
    // (x·rstd)·w per column, as the pre-norm kernel writes it; zero past D.
    var r = vec4<f32>(0.0);
    let x = src[v];
    for (var c = 0u; c < 4u; c++) {
        let k = 4u * v + c;
        if (k < D) {
            r[c] = x[c] * nrm_rstd * norm_w(k);
        }
    }
    return r;
#else
    return src[v] * col_scale(v * 4u);
#endif
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
    let lane = lid % TEAM;
    // The workgroup's linear index (the grid folds into 2-D past 65535) and its first row.
    let wlin = wid.x + wid.y * nwg.x;
    let first_row = wlin * R;
    let row_raw = first_row + lid / TEAM;
    let row = min(row_raw, M - 1u);
    let base = row * NV;
#if EARLY
    // q8_0 with the folded pre-norm: the first round's weights and scales go out before the
    // prologue, which they do not depend on, so its latency hides behind theirs (on a
    // narrow model they are most of the row).
#for u UNROLL
    let pw{u} = w[base + min(lane + {u}u * TEAM, NV - 1u)];
    let pd{u} = ws[(row * (KP / 32u) + min(lane + {u}u * TEAM, NV - 1u) / 2u) / 2u];
#endfor
#endif
#if EARLY_F32
    // f32 with the folded pre-norm (the MoE router): all of the lane's NVT weight vectors
    // go out before the prologue.
#for u NVT
    let pw{u} = w[base + min(lane + {u}u * TEAM, NV - 1u)];
#endfor
#endif
#if X_NORM
#if !SUBGROUP
    let sg_lane = 0u;
    let sg_size = 1u;
#endif
    // Every workgroup sums the whole residual (a few KB from cache), the pre-norm kernel's
    // way.
    nrm_rstd = norm_rstd(0u, lid, sg_lane, sg_size);
#if X_LOCAL
    // All of the normed vector's q8 blocks, in this workgroup's memory (zero past D).
    for (var first = 0u; first < KP; first += WG) {
        let k = first + lid;
        var v = 0.0;
        if (k < D) {
            v = norm_x(k) * nrm_rstd * norm_w(k);
        }
        q8_chunk(v, lid, first, 0u);
    }
    workgroupBarrier();
#else
    // The first workgroups write its output chunks (WG values each) and their q8 blocks.
    for (var first = wlin * WG; first < D; first += WG * nwg.x * nwg.y) {
        let k = first + lid;
        var v = 0.0;
        if (k < D) {
            v = norm_x(k) * nrm_rstd * norm_w(k);
            h_out[k] = v;
        }
#if Q8_OUT
        q8_chunk(v, lid, first, 0u);
#endif
    }
#endif
#endif
#if X_GROUP
    // rstd per group from the per-block sums of squares of v (BPG blocks per group): GSUB
    // invocations per group sum strided shares, then `group_sum` (one invocation summing a
    // group's BPG partials alone cost 2.7b's out_proj more than its weights).
    {
        let g = lid / GSUB;
        var s = 0.0;
        if (g < G) {
            for (var i = lid % GSUB; i < BPG; i += GSUB) {
                s += part[g * BPG + i];
            }
        }
        let t = group_sum(s, lid);
        if (g < G && lid % GSUB == 0u) {
            grp_rstd[g] = inverseSqrt(t / f32(GS) + EPS);
        }
        workgroupBarrier();
    }
#endif
    var acc = 0.0;
#if W_Q8
    // UNROLL vectors per lane and round, every load issued before the first product; the
    // sum still takes one vector after the other, in the order of one per round.
    for (var v0 = lane; v0 < NV; v0 += UNROLL * TEAM) {
#for u UNROLL
        let v{u} = min(v0 + {u}u * TEAM, NV - 1u);
        let si{u} = row * (KP / 32u) + v{u} / 2u;
#if EARLY
        var wv{u} = pw{u};
        var dw{u} = pd{u};
        if (v0 != lane) {
            wv{u} = w[base + v{u}];
            dw{u} = ws[si{u} / 2u];
        }
#else
        let wv{u} = w[base + v{u}];
        let dw{u} = ws[si{u} / 2u];
#endif
        let a{u} = xq[v{u}];
        let dx{u} = xd[v{u} / 2u];
#endfor
#for u UNROLL
        if (v0 + {u}u * TEAM < NV) {
            acc += f32(dot16(wv{u}, a{u})) * (unpack2x16float(dw{u})[si{u} % 2u] * dx{u} * col_scale((v{u} / 2u) * 32u));
        }
#endfor
    }
#else
#if W_HALF
    for (var v0 = lane; v0 < NV; v0 += UNROLL * TEAM) {
#for u UNROLL
        let v{u} = min(v0 + {u}u * TEAM, NV - 1u);
        let wv{u} = w[base + v{u}];
        let xa{u} = src[2u * v{u}];
        let xb{u} = src[2u * v{u} + 1u];
#endfor
#for u UNROLL
        if (v0 + {u}u * TEAM < NV) {
            let xa = xa{u} * col_scale(v{u} * 8u);
            let xb = xb{u} * col_scale(v{u} * 8u + 4u);
            acc += dot(vec4<f32>(half2(wv{u}.x), half2(wv{u}.y)), xa)
                + dot(vec4<f32>(half2(wv{u}.z), half2(wv{u}.w)), xb);
        }
#endfor
    }
#else
#if W_BLOCK
    for (var v0 = lane; v0 < NV; v0 += UNROLL * TEAM) {
#for u UNROLL
        let v{u} = min(v0 + {u}u * TEAM, NV - 1u);
        let l{u} = unit_load(row, 0u, v{u});
#endfor
#for u UNROLL
        if (v0 + {u}u * TEAM < NV) {
            acc += unit_dot(l{u}, row, v{u});
        }
#endfor
    }
#else
#if EARLY_F32
    // (The loop's order: one vector after the other.)
#for u NVT
    if (lane + {u}u * TEAM < NV) {
        acc += dot(pw{u}, x_vec4(lane + {u}u * TEAM));
    }
#endfor
#else
    for (var v = lane; v < NV; v += TEAM) {
#if W_F32
        let wv = w[base + v];
        acc += dot(wv, x_vec4(v));
#endif
    }
#endif
#endif
#endif
#endif
    let total = team_sum(acc, lid);
    if (lane == 0u && row_raw < M) {
        emit(0u, row, total);
    }
#if O_KV
    // The workgroup's rows through workgroup memory: an f16 cache word holds two rows
    // (R is even and k and v start on even rows, so both are this workgroup's).
    if (lane == 0u) {
        kv_rows[lid / TEAM] = total;
    }
    workgroupBarrier();
    {
        let r = first_row + lid;
        let pos = kv_ctrl.kv_len;
        if (lid < R && r >= KV_Q && r < KV_Q + 2u * KV_N && r < M && kv_ctrl.stopped == 0u && pos < CTX) {
            let is_v = r >= KV_Q + KV_N;
            let e = r - KV_Q - select(0u, KV_N, is_v);
#if KV_F32
            if (is_v) {
                v_cache[pos * KV_N + e] = kv_rows[lid];
            } else {
                k_cache[pos * KV_N + e] = kv_rows[lid];
            }
#else
            if (e % 2u == 0u) {
                let packed = pack2x16float(vec2<f32>(kv_rows[lid], kv_rows[lid + 1u]));
                if (is_v) {
                    v_cache[(pos * KV_N + e) / 2u] = packed;
                } else {
                    k_cache[(pos * KV_N + e) / 2u] = packed;
                }
            }
#endif
        }
    }
#endif
#if O_ARGMAX
    if (lane == 0u) {
        amax_rows[lid / TEAM] = total;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var bv = -3.4e38;
        var bi = 0xffffffffu;
        var bad = 0u;
        for (var r = 0u; r < R; r++) {
            if (first_row + r < M) {
                let v = amax_rows[r];
                if (is_nonfinite(v)) {
                    bad = 1u;
                }
                if (ranks_before(v, first_row + r, bv, bi)) {
                    bv = v;
                    bi = first_row + r;
                }
            }
        }
        amax_part[wlin] = vec4<u32>(bitcast<u32>(bv), bi, bad, 0u);
    }
#endif
}
