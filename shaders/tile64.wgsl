// A 64×64 output tile accumulated by 256 invocations from 16-deep slices staged in
// workgroup memory (the small GEMMs of the chunked SSD): invocation (lid/16, lid%16) owns
// rows 4·(lid/16).. and columns 4·(lid%16).., as four vec4 registers (one per row).
// Callers stage a slice with tile_put (row or column r at depth k), then call tile_step.

var<workgroup> ta: array<array<vec4<f32>, 17>, 16>;
var<workgroup> tb: array<array<vec4<f32>, 17>, 16>;

struct Tile {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
}

fn tile_fma(acc: ptr<function, Tile>, lid: u32) {
    let ri = lid / 16u;
    let ci = lid % 16u;
    for (var k = 0u; k < 16u; k++) {
        let a = ta[k][ri];
        let b = tb[k][ci];
        (*acc).r0 += a.x * b;
        (*acc).r1 += a.y * b;
        (*acc).r2 += a.z * b;
        (*acc).r3 += a.w * b;
    }
}

// Stages a[k][row r] and b[k][column r] of the next 16-deep slice. Callers pick which of
// k and r consecutive invocations walk to match their sources' layout: k fastest where
// both sources are contiguous along k (16 neighbours read 64 bytes), r fastest where they
// are contiguous along rows.
fn tile_put(k: u32, r: u32, a: f32, b: f32) {
    tile_put_a(k, r, a);
    tile_put_b(k, r, b);
}

// tile_put for one operand, where a and b are contiguous along different axes.
fn tile_put_a(k: u32, r: u32, a: f32) {
    ta[k][r / 4u][r % 4u] = a;
}

fn tile_put_b(k: u32, r: u32, b: f32) {
    tb[k][r / 4u][r % 4u] = b;
}

// Accumulates the staged slice once every invocation has staged its part; the slice may
// be overwritten after it returns. Call from uniform control flow.
fn tile_step(acc: ptr<function, Tile>, lid: u32) {
    workgroupBarrier();
    tile_fma(acc, lid);
    workgroupBarrier();
}

// Row r (0…3) of an invocation's tile.
fn tile_row(t: Tile, r: u32) -> vec4<f32> {
    return array<vec4<f32>, 4>(t.r0, t.r1, t.r2, t.r3)[r];
}

// Scales the four rows by s.x … s.w.
fn tile_scale(t: ptr<function, Tile>, s: vec4<f32>) {
    (*t).r0 *= s.x;
    (*t).r1 *= s.y;
    (*t).r2 *= s.z;
    (*t).r3 *= s.w;
}
