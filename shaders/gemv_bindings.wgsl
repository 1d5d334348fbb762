// The bindings, vector width and integer dot of the GEMV kernels (gemv.wgsl, one token;
// gemv_lanes.wgsl, a batch's lanes: NL of them per workgroup, 1 for gemv.wgsl).

#if W_F32
@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;
const VW: u32 = 4u;
#endif
#if W_HALF
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
const VW: u32 = 8u;
#endif
#if W_Q8
@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ws: array<u32>;
const VW: u32 = 16u;
#endif
#if X_Q8
#if X_LOCAL
// The block's pre-norm folded into a one-token GEMV of quantized weights: `src` is the
// residual, and every workgroup makes the q8 blocks of the normed vector in its own
// memory (the norm kernel's values, bit for bit), where the products read them.
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
var<workgroup> xq: array<vec4<u32>, KP / 16u>;
var<workgroup> xd: array<f32, KP / 32u>;
#else
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xd: array<f32>;
#endif

// The q8 input as gemv_units.wgsl reads it.
fn x_q(i: u32) -> vec4<u32> {
    return xq[i];
}

fn x_d(i: u32) -> f32 {
    return xd[i];
}
#else
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
#endif
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
#if O_MIXER
@group(0) @binding(6) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(7) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(8) var<storage, read> params: array<f32>;
#endif
#if X_NORM
// The block's pre-norm folded in (one token): `src` is the residual, the norm weights sit
// at NW_OFF of the parameters (the mixer epilogue's, where there is one). f32 weights:
// the first workgroups write the normed vector and its q8 blocks for the GEMVs after this
// one; quantized ones (X_LOCAL): the q8 blocks go to workgroup memory only.
#if O_MIXER
fn norm_w(k: u32) -> f32 {
    return params[NW_OFF + k];
}
#else
@group(0) @binding(8) var<storage, read> nparams: array<f32>;
fn norm_w(k: u32) -> f32 {
    return nparams[NW_OFF + k];
}
#endif
#if !X_LOCAL
@group(0) @binding(10) var<storage, read_write> h_out: array<f32>;
#if Q8_OUT
@group(0) @binding(11) var<storage, read_write> xq: array<u32>;
@group(0) @binding(12) var<storage, read_write> xd: array<f32>;
#endif
#endif
var<private> nrm_rstd: f32;

fn norm_x(i: u32) -> f32 {
    return src[i / 4u][i % 4u];
}
#endif
#if X_GROUP
@group(0) @binding(9) var<storage, read> part: array<f32>;
var<workgroup> grp_rstd: array<f32, G * NL>;
var<workgroup> grp_red: array<f32, WG>;
#endif

const NV: u32 = KP / VW;

#if O_KV
// One-token qkv GEMV (NoPE attention): the k and v rows (rows KV_Q .. KV_Q + 2·KV_N of
// [q | k | v]) also go to cache row kv_ctrl.kv_len of k_cache / v_cache ([CTX][KV_N],
// f32, or f16 two per u32), what the K/V store kernel writes; nothing when the step is
// stopped or the cache full.
#if KV_F32
@group(0) @binding(14) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(15) var<storage, read_write> v_cache: array<f32>;
#else
@group(0) @binding(14) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(15) var<storage, read_write> v_cache: array<u32>;
#endif
@group(0) @binding(16) var<storage, read> kv_ctrl: Ctrl;
var<workgroup> kv_rows: array<f32, R>;
#endif

#if O_ARGMAX
// One-token greedy lm_head: per workgroup (linear index), its best row as (bits of the
// value, row, any row NaN or ±Inf, 0) by `ranks_before`, which the argmax then reduces
// instead of every logit.
@group(0) @binding(13) var<storage, read_write> amax_part: array<vec4<u32>>;
var<workgroup> amax_rows: array<f32, R>;
#endif

#if X_GROUP
// Σ over the GSUB consecutive invocations of lid's group-norm share (GSUB a power of two);
// the first of them gets it. As `team_sum` sums a team: with TEAM_SHUFFLE a butterfly of
// subgroupShuffleXor over pieces of GPIECE lanes (inside one subgroup), the GSUB/GPIECE
// pieces then summed in order in workgroup memory; otherwise a workgroup-memory tree.
// Every invocation of the workgroup must call it (uniform control flow).
fn group_sum(v: f32, lid: u32) -> f32 {
#if TEAM_SHUFFLE
    var s = v;
    for (var o = GPIECE / 2u; o > 0u; o /= 2u) {
        s += subgroupShuffleXor(s, o);
    }
    if (GSUB == GPIECE) {
        return s;
    }
    if (lid % GPIECE == 0u) {
        grp_red[lid / GPIECE] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    if (lid % GSUB == 0u) {
        let first = lid / GPIECE;
        for (var i = 0u; i < GSUB / GPIECE; i++) {
            t += grp_red[first + i];
        }
    }
    workgroupBarrier();
    return t;
#else
    grp_red[lid] = v;
    workgroupBarrier();
    for (var o = GSUB / 2u; o > 0u; o /= 2u) {
        if ((lid % GSUB) < o) {
            grp_red[lid] += grp_red[lid + o];
        }
        workgroupBarrier();
    }
    let t = grp_red[lid - lid % GSUB];
    workgroupBarrier();
    return t;
#endif
}
#endif

#if STAGE
// The staged batch kernel's rows: quants and their scales as f32.
var<workgroup> wsh: array<vec4<u32>, RR * NV>;
var<workgroup> dsh: array<f32, RR * (KP / 32u)>;
#endif

// Lane l's total of row `row` to its output (O_STORE | O_ADD | O_MIXER; lane 0 for the
// one-token kernel), at value Y0 + row of the lane's (a part of a stacked projection whose
// parts are stored in different formats: its rows' place in the whole), times RS (the
// matrix's output scale: Granite's residual multiplier on a block's last projection).
fn emit(l: u32, row: u32, total: f32) {
#if O_STORE
    dst[Y0 + l * DST_LS + row] = RS * total;
#endif
#if O_ADD
    dst[Y0 + l * DST_LS + row] += RS * total;
#endif
#if O_MIXER
    mixer_row(l, row, total);
#endif
}

