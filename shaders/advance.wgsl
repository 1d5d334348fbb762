// Prefill through the decode graph: after a prompt token has been fed, the next embed
// reads the next prompt token. One thread.

@group(0) @binding(0) var<storage, read> prompt: array<u32>;
@group(0) @binding(1) var<storage, read_write> ctrl: Ctrl;

@compute @workgroup_size(1)
fn main() {
    ctrl.cursor += 1u;
    ctrl.kv_len += 1u;
    if (ctrl.cursor < ctrl.prompt_len) {
        ctrl.token = prompt[ctrl.cursor];
    }
}
