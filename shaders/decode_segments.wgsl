// The segments the decode attention cuts a lane's rows in use into, shared by its two
// halves (attention_decode writes a partial per segment with rows, attention_combine reads
// exactly those), which must agree on them. Constants: SEGK, NSEG (`segment_consts`).

// Keys per segment for `len` rows in use: the rows over NSEG, rounded up to SEGK.
fn seg_len(len: u32) -> u32 {
    return SEGK * max(1u, (len + SEGK * NSEG - 1u) / (SEGK * NSEG));
}

// The segments of `seg` keys that hold rows of `len`.
fn live_segments(len: u32, seg: u32) -> u32 {
    return (len + seg - 1u) / seg;
}
