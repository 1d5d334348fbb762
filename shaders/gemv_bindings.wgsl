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
#if W_Q4_0
const VW: u32 = 32u;
#endif
#if W_K4
const VW: u32 = 32u;
#endif
#if W_Q6_K
const VW: u32 = 64u;
#endif
#if X_Q8
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> xd: array<f32>;
#else
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
#endif
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
#if O_MIXER
@group(0) @binding(6) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(7) var<storage, read> ctrl: array<Ctrl>;
@group(0) @binding(8) var<storage, read> params: array<f32>;
#endif
#if X_GROUP
@group(0) @binding(9) var<storage, read> part: array<f32>;
var<workgroup> grp_rstd: array<f32, G * NL>;
var<workgroup> grp_red: array<f32, WG>;
#endif

const NV: u32 = KP / VW;

#if STAGE
// The staged batch kernel's rows: quants and their scales as f32.
var<workgroup> wsh: array<vec4<u32>, RR * NV>;
var<workgroup> dsh: array<f32, RR * (KP / 32u)>;
#endif

// Σ over 16 q8 values of q_w·q_x: four dot4I8Packed of weight bytes `q` and input `x`.
fn dot16(q: vec4<u32>, x: vec4<u32>) -> i32 {
    return dot4I8Packed(q.x, x.x) + dot4I8Packed(q.y, x.y) + dot4I8Packed(q.z, x.z) + dot4I8Packed(q.w, x.w);
}
