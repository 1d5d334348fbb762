// How the SSD kernels on cooperative matrices read the conv's output u [T][CD]: 4-value
// slices, from f16 (U16: what prefill_conv writes when all three of them run, since they
// round u to f16 on its way into the tensor cores anyway; half the bytes written and read)
// or from f32. Each kernel declares `u` itself: array<vec2<u32>> under U16, array<vec4<f32>>
// else.

// The raw words of slice i (f16: two words, then two zeros; f32: the four values' bits),
// for a kernel that holds its loads in registers across its products: converted only when
// stored, after them (a conversion right after the load waits for the load there: the
// chunk scan took 33.3 → 47.6 ms on the H200 that way, run 84).
fn u_raw(i: u32) -> vec4<u32> {
#if U16
    return vec4<u32>(u[i], 0u, 0u);
#else
    return bitcast<vec4<u32>>(u[i]);
#endif
}

// The four values of a `u_raw` slice.
fn u_values(r: vec4<u32>) -> vec4<f32> {
#if U16
    return vec4<f32>(unpack2x16float(r.x), unpack2x16float(r.y));
#else
    return bitcast<vec4<f32>>(r);
#endif
}

// The four values of slice i.
fn u4(i: u32) -> vec4<f32> {
    return u_values(u_raw(i));
}
