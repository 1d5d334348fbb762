// Synthetic weights made on the device (benchmarks at real shapes without a checkpoint):
// word i of a buffer gets random bits from the sampler's hash. MODE 0: f32 in [lo, hi);
// MODE 1: two f16 in [lo, hi); MODE 2: four int8 in [-127, 127]; MODE 3: a constant word;
// MODE 4: four constant words repeated (a 16-byte field per block).

struct Fill {
    count: u32,
    seed: u32,
    mode: u32,
    word: u32,
    lo: f32,
    hi: f32,
    pad0: u32,
    pad1: u32,
    pattern: vec4<u32>,
}

@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> f: Fill;

fn hash(x: u32) -> u32 {
    let state = x * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn unit(h: u32) -> f32 {
    return f.lo + (f.hi - f.lo) * (f32(h >> 8u) * (1.0 / 16777216.0));
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= f.count) {
        return;
    }
    let h = hash(f.seed ^ hash(i));
    switch (f.mode) {
        case 0u: {
            out[i] = bitcast<u32>(unit(h));
        }
        case 1u: {
            out[i] = pack2x16float(vec2<f32>(unit(h), unit(hash(h))));
        }
        case 2u: {
            let b = vec4<i32>(vec4<u32>(h & 0xffu, (h >> 8u) & 0xffu, (h >> 16u) & 0xffu, h >> 24u)) - vec4<i32>(127);
            out[i] = pack4xI8(clamp(b, vec4<i32>(-127), vec4<i32>(127)));
        }
        case 4u: {
            out[i] = f.pattern[i % 4u];
        }
        default: {
            out[i] = f.word;
        }
    }
}
