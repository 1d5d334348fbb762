// One row of the in_proj output turned into what the SSD step reads (used by the fused
// in_proj epilogue and by the unfused conv_step kernel). `dst` is the [z | xBC | dt] row
// vector; after this, it holds [z | u = silu(conv(xBC)) | δ = softplus(dt + dt_bias)].
// Lane l (batched decode) works on row vector dst [l][MIX_LS], its slot's conv state
// conv_state [l][CONV_LS] and ctrl[l].
// Needs: dst (read_write), params (the layer's small tensors), conv_state, ctrl (array);
// constants DI, CD, KC, CW_OFF, CB_OFF, DTB_OFF, DT_MIN, DT_MAX, MIX_LS, CONV_LS.

#if MIXER_ROW
fn mixer_row(l: u32, row: u32, val: f32) {
    let at = l * MIX_LS + row;
    if (row < DI) {
        dst[at] = val;
        return;
    }
    if (row < DI + CD) {
        // Causal depthwise conv over [the K-1 cached inputs, this input], oldest first.
        let c = row - DI;
        let base = l * CONV_LS + c * (KC - 1u);
        var acc = params[CB_OFF + c] + params[CW_OFF + c * KC + KC - 1u] * val;
        for (var j = 0u; j < KC - 1u; j++) {
            acc += params[CW_OFF + c * KC + j] * conv_state[base + j];
        }
        if (ctrl[l].stopped == 0u) {
            for (var j = 0u; j + 2u < KC; j++) {
                conv_state[base + j] = conv_state[base + j + 1u];
            }
            conv_state[base + KC - 2u] = val;
        }
        dst[at] = silu(acc);
        return;
    }
    let h = row - DI - CD;
    dst[at] = clamp(softplus(val + params[DTB_OFF + h]), DT_MIN, DT_MAX);
}
#endif
