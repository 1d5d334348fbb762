// y = W·x for each of up to NL lanes per workgroup (gemv.wgsl is the one-token kernel):
// W [M, K] in f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k (rows zero-padded
// to KP columns; the 4/5/6-bit layouts and bindings are block_quant.wgsl's).
// A team of TEAM consecutive invocations owns a row and strides over it with 16-byte
// loads; R = WG/TEAM teams per workgroup, each owning RT consecutive rows (the lanes'
// inputs loaded once for the RT rows); one team reduction per row and lane. The input is ready:
// f32 `src [KP]` (zero past K) for f32/f16 weights, q8 blocks `xq`/`xd` (X_Q8) for the
// quantized ones (made once per token by the producer kernel, so no workgroup repeats that
// work), multiplied with dot4I8Packed: 4-bit quants are widened to bytes in registers
// (q4_0's offset of 8 by a sign flip, the k-quants' mins by Σq_x of the block), q6_k's
// 6-bit ones as 4·(q−32).
// Lanes (batched decode): the workgroup of lane group z (of LG) takes lanes z·NL … z·NL +
// NL − 1 (those below LANES) and reads each weight once for all of them; lane l's input starts at l·X_LS (f32) or
// l·X_LS/16 (xq vectors), l·X_LS/32 (q8 block scales), its output at l·DST_LS, its norm partials at l·PART_LS.
// Each lane's sum runs in exactly the order of a one-lane GEMV (the same team, stride and
// expressions), so a lane's result is bitwise the one it gets alone.
// Flags: W_F32 | W_HALF (W_F16 | W_BF16) | W_Q8 | W_Q4_0 | W_Q4_1 | W_Q5 (W_Q5_0 | W_Q5_1) | W_K4 (W_Q4_K | W_Q5_K) | W_Q6_K;  X_GROUP (x_k is scaled by its group's rstd, from the SSD
// step's per-block Σv²: the gated group norm folded in);  O_STORE | O_ADD | O_MIXER;
// LANES_SIDE (the workgroup order, see main); TEAM_ALL (team_sum's total in every lane);
// TEAM_SCATTER, TEAM_WIDE, EMIT_ROUNDS (how the totals are summed and go out, see the end).

#if TEAM_WIDE
// The reduce-scatter's piece totals (WG / SUB pieces of NT), for teams wider than a piece.
var<workgroup> scat: array<f32, (WG / SUB) * NT>;
#endif

// The group-norm factor of input column k for lane slot j (1 without X_GROUP).
fn col_scale(j: u32, k: u32) -> f32 {
#if X_GROUP
    return grp_rstd[j * G + k / GS];
#else
    return 1.0;
#endif
}

// Lane slot j's lane in lane group z (of NL lanes), the last lane repeated past LANES.
fn lane_of(z: u32, j: u32) -> u32 {
    return min(z * NL + j, LANES - 1u);
}

// Total o of the register kernel's team whose rows start at `first` in lane group z (row
// first + o / NL, lane slot o % NL) to its output, unless it is padding or past M or LANES.
fn emit_total(z: u32, first: u32, o: u32, total: f32) {
    let j = o % NL;
    if (o < RT * NL && first + o / NL < M && z * NL + j < LANES) {
        emit(lane_of(z, j), first + o / NL, total);
    }
}

// A lane's first q8 input word and block scale, and its first f32 input vector.
fn xq_at(l: u32) -> u32 {
    return l * (X_LS / 16u);
}
fn xd_at(l: u32) -> u32 {
    return l * (X_LS / 32u);
}
fn src_at(l: u32) -> u32 {
    return l * (X_LS / 4u);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Workgroup (row group rg of RGN, lane group zg of LG). LANES_SIDE: lane group fastest,
    // so the LG workgroups that read one row group's weights run side by side and those
    // weights come from DRAM once, from L2 for the other lane groups; else row group
    // fastest, each lane group sweeping the whole matrix in turn.
    let lin = wid.x + wid.y * nwg.x;
#if LANES_SIDE
    let zg = lin % LG;
    let rg = lin / LG;
#else
    let rg = lin % RGN;
    let zg = lin / RGN;
#endif
    if (rg >= RGN || zg >= LG) {
        return;
    }
    // Slots past LANES repeat the last lane and write nothing.
#for j NL
    let ln_{j} = lane_of(zg, {j}u);
#endfor
#if X_GROUP
    // rstd per group from the per-block sums of squares of v (BPG blocks per group), for
    // each lane exactly as gemv.wgsl's prologue (GSUB invocations per group sum strided
    // shares, then `group_sum`), WG / (G·GSUB) lanes at a time.
    for (var j0 = 0u; j0 < NL; j0 += WG / (G * GSUB)) {
        let j = j0 + lid / (G * GSUB);
        let g = (lid / GSUB) % G;
        var s = 0.0;
        if (j < NL) {
            let l = lane_of(zg, j);
            for (var i = lid % GSUB; i < BPG; i += GSUB) {
                s += part[l * PART_LS + g * BPG + i];
            }
        }
        let t = group_sum(s, lid);
        if (j < NL && lid % GSUB == 0u) {
            grp_rstd[j * G + g] = inverseSqrt(t / f32(GS) + EPS);
        }
    }
    workgroupBarrier();
#endif
#if STAGE
    // Staged q8_0 (STAGE): the workgroup's RR rows go to workgroup memory first, every
    // invocation's loads in flight at once, so the weights stream at many workgroups per
    // multiprocessor instead of the few that a thread's registers for all NL lanes allow.
    // Then invocation (t, r, g) = (lid % TEAM, row, lane group) sums row r for lanes
    // g·LPT … g·LPT + LPT − 1 over v ≡ t (mod TEAM) in order: the one-token kernel's team,
    // stride and expressions, so each lane is bitwise its run alone.
    let first = rg * RR;
    for (var i = lid; i < RR * NV; i += WG) {
        wsh[i] = w[min(first + i / NV, M - 1u) * NV + i % NV];
    }
    for (var i = lid; i < RR * (KP / 32u); i += WG) {
        let si = min(first + i / (KP / 32u), M - 1u) * (KP / 32u) + i % (KP / 32u);
        dsh[i] = unpack2x16float(ws[si / 2u])[si % 2u];
    }
    workgroupBarrier();
    let t = lid % TEAM;
    let r = (lid / TEAM) % RR;
    let g = lid / (TEAM * RR);
    let row = min(first + r, M - 1u);
#for j LPT
    let slot_{j} = g * LPT + {j}u;
    let lt_{j} = lane_of(zg, min(slot_{j}, NL - 1u));
    var acc_{j} = 0.0;
#endfor
    for (var v = t; v < NV; v += TEAM) {
        let wv = wsh[r * NV + v];
        let blk = v / 2u;
        let d = dsh[r * (KP / 32u) + blk];
#for j LPT
        {
            let a = xq[xq_at(lt_{j}) + v];
            let xs = xd[xd_at(lt_{j}) + blk];
            let cs = col_scale(min(slot_{j}, NL - 1u), blk * 32u);
            acc_{j} += f32(dot16(wv, a)) * (d * xs * cs);
        }
#endfor
    }
    // Total j goes out from lane j of the team (LPT ≤ TEAM), all of them at once.
    var out = 0.0;
#for j LPT
    {
        let total = team_sum(acc_{j}, lid);
        out = select(out, total, t == {j}u);
    }
#endfor
    {
        let slot = g * LPT + t;
        if (t < LPT && first + r < M && slot < NL && zg * NL + slot < LANES) {
            emit(lane_of(zg, slot), row, out);
        }
    }
#else
    let lane = lid % TEAM;
    // This team's RT consecutive rows (each reduced exactly as the one-token kernel reduces
    // a row: the same team size, stride and order); each lane's input is loaded once for
    // all RT rows. Straight-line code (#for): every accumulator is its own variable.
    let first = (rg * R + lid / TEAM) * RT;
#for r RT
    let row_{r} = min(first + {r}u, M - 1u);
#for j NL
    var acc_{r}_{j} = 0.0;
#endfor
#endfor
    for (var v = lane; v < NV; v += TEAM) {
#if W_Q4_0
#for r RT
        {
            // The block's 16·(q − 8) bytes (block_quant.wgsl's `q4_bytes`).
            let si = row_{r} * (KP / 32u) + v;
            let b = q4_bytes(w[si]);
            let d = unpack2x16float(ws[si / 2u])[si % 2u];
#for j NL
            {
                let xo = xq_at(ln_{j});
                let idot = dot16(b[0], xq[xo + 2u * v]) + dot16(b[1], xq[xo + 2u * v + 1u]);
                acc_{r}_{j} += f32(idot) * (d * 0.0625 * xd[xd_at(ln_{j}) + v] * col_scale({j}u, v * 32u));
            }
#endfor
        }
#endfor
#endif
#if W_Q5_0
#for r RT
        {
            // The block's 8·(q − 16) bytes (block_quant.wgsl's `q5_bytes`, as
            // gemv_units.wgsl's unit_dot takes them).
            let si = row_{r} * (KP / 32u) + v;
            let sv = ws[si];
            let b = q5_bytes(w[si], sv.x);
            let d = unpack2x16float(sv.y).x;
#for j NL
            {
                let xo = xq_at(ln_{j});
                let idot = dot16(b[0], xq[xo + 2u * v]) + dot16(b[1], xq[xo + 2u * v + 1u]);
                acc_{r}_{j} += f32(idot) * (d * 0.125 * xd[xd_at(ln_{j}) + v] * col_scale({j}u, v * 32u));
            }
#endfor
        }
#endfor
#endif
#if W_Q4_1
#for r RT
        {
            // Levels 0…15 of d·q + m: d·Σq·x + m·Σx (gemv_units.wgsl's unit_dot).
            let si = row_{r} * (KP / 32u) + v;
            let q = w[si];
            let lo = q & vec4<u32>(0x0F0F0F0Fu);
            let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
            let dm = unpack2x16float(ws[si]);
#for j NL
            {
                let xo = xq_at(ln_{j});
                let x0 = xq[xo + 2u * v];
                let x1 = xq[xo + 2u * v + 1u];
                let ones = vec4<u32>(0x01010101u);
                let idot = dot16(lo, x0) + dot16(hi, x1);
                let isum = dot16(ones, x0) + dot16(ones, x1);
                acc_{r}_{j} += (dm.x * f32(idot) + dm.y * f32(isum)) * (xd[xd_at(ln_{j}) + v] * col_scale({j}u, v * 32u));
            }
#endfor
        }
#endfor
#endif
#if W_Q5_1
#for r RT
        {
            // Levels 0…31 (block_quant.wgsl's `q5_levels`), multiplied as W_Q4_1's.
            let si = row_{r} * (KP / 32u) + v;
            let sv = ws[si];
            let b = q5_levels(w[si], sv.x);
            let dm = unpack2x16float(sv.y);
#for j NL
            {
                let xo = xq_at(ln_{j});
                let x0 = xq[xo + 2u * v];
                let x1 = xq[xo + 2u * v + 1u];
                let ones = vec4<u32>(0x01010101u);
                let idot = dot16(b[0], x0) + dot16(b[1], x1);
                let isum = dot16(ones, x0) + dot16(ones, x1);
                acc_{r}_{j} += (dm.x * f32(idot) + dm.y * f32(isum)) * (xd[xd_at(ln_{j}) + v] * col_scale({j}u, v * 32u));
            }
#endfor
        }
#endfor
#endif
#if W_K4
#for r RT
        {
            // 16 quant bytes of a superblock: low nibbles are 16 values of sub-block 2i,
            // high nibbles 16 of sub-block 2i+1 (i = c/2, the half h = c%2 of their 32).
            // W_Q5_K adds each value's fifth bit from the superblock's qh bytes 16h…16h+16
            // (bit 2i for sub-block 2i, 2i+1 for 2i+1): levels 0…31 are still positive int8.
            let sb = row_{r} * (KP / 256u) + v / 8u;
            let c = v % 8u;
            let i = c / 2u;
            let h = c % 2u;
            let q = w[sb * K4_DV + c];
            let ones = vec4<u32>(0x01010101u);
            var lo = q & vec4<u32>(0x0F0F0F0Fu);
            var hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
#if W_Q5_K
            let qh = w[sb * K4_DV + 8u + h];
            lo |= ((qh >> vec4<u32>(2u * i)) & ones) << vec4<u32>(4u);
            hi |= ((qh >> vec4<u32>(2u * i + 1u)) & ones) << vec4<u32>(4u);
#endif
            let b0 = (v / 8u) * 8u + 2u * i;
            let sv = ws[sb];
            let dm = unpack2x16float(sv.x);
            let s0 = k4_scale_min(sv, 2u * i);
            let s1 = k4_scale_min(sv, 2u * i + 1u);
#for j NL
            {
                let xo = xq_at(ln_{j});
                let x0 = xq[xo + 2u * b0 + h];
                let x1 = xq[xo + 2u * b0 + 2u + h];
                let xdo = xd_at(ln_{j});
                let p0 = dm.x * s0.x * f32(dot16(lo, x0)) - dm.y * s0.y * f32(dot16(ones, x0));
                let p1 = dm.x * s1.x * f32(dot16(hi, x1)) - dm.y * s1.y * f32(dot16(ones, x1));
                acc_{r}_{j} += p0 * (xd[xdo + b0] * col_scale({j}u, b0 * 32u)) + p1 * (xd[xdo + b0 + 1u] * col_scale({j}u, b0 * 32u + 32u));
            }
#endfor
        }
#endfor
#endif
#if W_Q6_K
#for r RT
        {
            // 64 values of a superblock: half n, l = 16h…16h+16 of each of its four
            // quarters t (ql nibbles of two 16-byte runs, two bits each of one qh run);
            // (q ^ 32) << 2 is 4·(q − 32).
            let sbr = v / 4u;
            let sb = row_{r} * (KP / 256u) + sbr;
            let n = (v % 4u) / 2u;
            let h = v % 2u;
            let wbase = sb * 12u;
            let qa = w[wbase + 4u * n + h];
            let qb = w[wbase + 4u * n + 2u + h];
            let qh = w[wbase + 8u + 2u * n + h];
            let m4 = vec4<u32>(0x0F0F0F0Fu);
            let m2 = vec4<u32>(0x03030303u);
            let d = unpack2x16float(ws[sb * 5u + 4u]).x * 0.25;
            // The i8 scales 8n + 2t + h of the quarters: bytes h and h+2 of words 2n, 2n+1.
            let scw = vec2<u32>(ws[sb * 5u + 2u * n], ws[sb * 5u + 2u * n + 1u]);
#for t 4
            let qv_{t} = ((select(qa, qb, {t}u % 2u == 1u) >> vec4<u32>(4u * ({t}u / 2u))) & m4) | (((qh >> vec4<u32>(2u * {t}u)) & m2) << vec4<u32>(4u));
            let qs_{t} = ((qv_{t} ^ vec4<u32>(0x20202020u)) << vec4<u32>(2u)) & vec4<u32>(0xFCFCFCFCu);
            let sc_{t} = f32(bitcast<i32>(((scw[{t}u / 2u] >> (8u * (h + 2u * ({t}u % 2u)))) & 0xFFu) << 24u) >> 24u);
#endfor
#for j NL
            {
                let xo = xq_at(ln_{j});
                let xdo = xd_at(ln_{j});
                var part6 = 0.0;
#for t 4
                {
                    let b = sbr * 8u + 4u * n + {t}u;
                    part6 += f32(dot16(qs_{t}, xq[xo + 2u * b + h])) * (sc_{t} * xd[xdo + b] * col_scale({j}u, b * 32u));
                }
#endfor
                acc_{r}_{j} += part6 * d;
            }
#endfor
        }
#endfor
#endif
#if W_Q8
        // Each row's weights and scale once; each lane's input once for all RT rows.
        let blk = v / 2u;
#for r RT
        let w_{r} = w[row_{r} * NV + v];
        let si_{r} = row_{r} * (KP / 32u) + blk;
        let d_{r} = unpack2x16float(ws[si_{r} / 2u])[si_{r} % 2u];
#endfor
#for j NL
        {
            let a = xq[xq_at(ln_{j}) + v];
            let xs = xd[xd_at(ln_{j}) + blk];
            let cs = col_scale({j}u, blk * 32u);
#for r RT
            acc_{r}_{j} += f32(dot16(w_{r}, a)) * (d_{r} * xs * cs);
#endfor
        }
#endfor
#endif
#if W_HALF
#for r RT
        let wq_{r} = w[row_{r} * NV + v];
        let wa_{r} = vec4<f32>(half2(wq_{r}.x), half2(wq_{r}.y));
        let wb_{r} = vec4<f32>(half2(wq_{r}.z), half2(wq_{r}.w));
#endfor
#for j NL
        {
            let so = src_at(ln_{j});
            let xa = src[so + 2u * v] * col_scale({j}u, v * 8u);
            let xb = src[so + 2u * v + 1u] * col_scale({j}u, v * 8u + 4u);
#for r RT
            acc_{r}_{j} += dot(wa_{r}, xa) + dot(wb_{r}, xb);
#endfor
        }
#endfor
#endif
#if W_F32
#for r RT
        let wf_{r} = w[row_{r} * NV + v];
#endfor
#for j NL
        {
            let x = src[src_at(ln_{j}) + v] * col_scale({j}u, v * 4u);
#for r RT
            acc_{r}_{j} += dot(wf_{r}, x);
#endfor
        }
#endfor
#endif
    }
    // The team's RT·NL totals go out from its lanes side by side: the epilogues' loads and
    // stores (the residual's add, the mixer's conv state) then wait on memory once per
    // round, not once per total.
#if TEAM_SCATTER
    // The RT·NL sums (NT: padded with zeros to a power of two) by one reduce-scatter
    // butterfly over the pieces of SUB lanes: at the level of offset o each lane keeps half
    // of the totals it still holds, sends the other half to lane ^ o and adds what it gets
    // back — for every total the additions of `team_sum`'s butterfly (its own value + the
    // partner's, the same pairs in the same order), so each total is bitwise team_sum's,
    // for ~NT shuffles in all instead of log2(SUB) per total (run 135: Codestral's 16-lane
    // in_proj spent 7 % of its time in them). Piece lane s then holds totals
    // (s / REP)·PER + k, k < PER.
    var tot: array<f32, NT>;
#for r RT
#for j NL
    tot[{r}u * NL + {j}u] = acc_{r}_{j};
#endfor
#endfor
    let sl = lid % SUB;
#for l 7
    {
        // Offset O; HELD totals held before the level, KEPT after it (SUB ≤ 128: 7 levels).
        const O = SUB >> ({l}u + 1u);
        const HELD = max(NT >> {l}u, 1u);
        const KEPT = max(NT >> ({l}u + 1u), 1u);
        if (O >= 1u) {
            if (HELD >= 2u) {
                let up = (sl & O) != 0u;
#for k NTH
                if ({k}u < KEPT) {
                    let lo = tot[{k}u];
                    let hi = tot[min({k}u + KEPT, NT - 1u)];
                    tot[{k}u] = select(lo, hi, up) + subgroupShuffleXor(select(hi, lo, up), O);
                }
#endfor
            } else {
                tot[0] += subgroupShuffleXor(tot[0], O);
            }
        }
    }
#endfor
#if TEAM_WIDE
    // Teams wider than a piece: the pieces' totals meet in workgroup memory and total o
    // (o ≡ lane mod TEAM, ER rounds) is summed over them in order, as `team_sum` does.
    if (sl % REP == 0u) {
#for k PER
        scat[(lid / SUB) * NT + (sl / REP) * PER + {k}u] = tot[{k}u];
#endfor
    }
    workgroupBarrier();
#for q ER
    var out_{q} = 0.0;
    {
        let o = {q}u * TEAM + lane;
        if (o < RT * NL) {
            let piece = (lid / TEAM) * (TEAM / SUB);
            for (var i = 0u; i < TEAM / SUB; i++) {
                out_{q} += scat[(piece + i) * NT + o];
            }
        }
    }
#endfor
#else
    // Teams of one piece: each total goes out from the lane holding it.
    if (sl % REP == 0u) {
#for k PER
        emit_total(zg, first, (sl / REP) * PER + {k}u, tot[{k}u]);
#endfor
    }
#endif
#else
    // Total o from lane o % TEAM, in ER rounds.
#for q ER
    var out_{q} = 0.0;
#endfor
#for r RT
#for j NL
    {
        let total = team_sum(acc_{r}_{j}, lid);
#for q ER
        out_{q} = select(out_{q}, total, {r}u * NL + {j}u == {q}u * TEAM + lane);
#endfor
    }
#endfor
#endfor
#endif
#if EMIT_ROUNDS
#for q ER
    emit_total(zg, first, {q}u * TEAM + lane, out_{q});
#endfor
#endif
#endif
}
