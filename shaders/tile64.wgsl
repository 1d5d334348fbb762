// A 64×64 output tile accumulated by 256 invocations from 16-deep slices staged in
// workgroup memory (the small GEMMs of the chunked SSD): invocation (lid/16, lid%16) owns
// rows 4·(lid/16).. and columns 4·(lid%16).. of the tile. Callers fill ta[k][row] and
// tb[k][col], barrier, call tile_fma, barrier.

var<workgroup> ta: array<array<f32, 68>, 16>;
var<workgroup> tb: array<array<f32, 68>, 16>;

fn tile_fma(acc: ptr<function, array<vec4<f32>, 4>>, lid: u32) {
    let ri = (lid / 16u) * 4u;
    let ci = (lid % 16u) * 4u;
    for (var k = 0u; k < 16u; k++) {
        let b = vec4<f32>(tb[k][ci], tb[k][ci + 1u], tb[k][ci + 2u], tb[k][ci + 3u]);
        for (var r = 0u; r < 4u; r++) {
            (*acc)[r] += ta[k][ri + r] * b;
        }
    }
}
