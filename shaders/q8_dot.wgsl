// Σ over 16 q8 values of q_w·q_x: four dot4I8Packed of weight bytes `q` and input `x`
// (the integer products of every quantized GEMV).
fn dot16(q: vec4<u32>, x: vec4<u32>) -> i32 {
    return dot4I8Packed(q.x, x.x) + dot4I8Packed(q.y, x.y) + dot4I8Packed(q.z, x.z) + dot4I8Packed(q.w, x.w);
}
