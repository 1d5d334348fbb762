//! WGSL assembly: a kernel's source is `common.wgsl` + its own file, specialized by
//! constants (prepended as `const NAME = value;`) and by `#if FLAG` / `#else` / `#endif`
//! lines (for code that must not even be compiled without a feature, like subgroup
//! built-ins), and `#for VAR COUNT` / `#endfor` blocks repeated COUNT times (a constant's
//! name or a number) with `{VAR}` replaced by 0, 1, …: straight-line code over scalar
//! variables where a loop over a local array would leave the array in memory (NVIDIA's
//! compiler did, for the batch GEMV's accumulators). Pipelines are built once per
//! specialization at load.

use crate::error::{Error, Result};

pub const COMMON: &str = include_str!("../../shaders/common.wgsl");

/// A compile-time constant of a kernel.
#[derive(Clone, Copy, Debug)]
pub enum Const {
    U32(u32),
    F32(f32),
}

/// Builds the final WGSL text of a kernel from its sources (after `common.wgsl`).
pub fn assemble(
    name: &str,
    sources: &[&str],
    consts: &[(&str, Const)],
    flags: &[&str],
) -> Result<String> {
    let mut out =
        String::with_capacity(COMMON.len() + sources.iter().map(|s| s.len()).sum::<usize>() + 512);
    // `enable` directives must precede every declaration.
    for line in sources.iter().flat_map(|s| s.lines()) {
        if line.starts_with("enable ") {
            out.push_str(line);
            out.push('\n');
        }
    }
    for (k, v) in consts {
        match v {
            Const::U32(x) => out.push_str(&format!("const {k}: u32 = {x}u;\n")),
            Const::F32(x) => out.push_str(&format!("const {k}: f32 = {x:e};\n")),
        }
    }
    let lines: Vec<String> = std::iter::once(COMMON)
        .chain(sources.iter().copied())
        .flat_map(str::lines)
        .map(str::to_string)
        .collect();
    let lines = unroll(name, &lines, consts)?;
    // (active, seen_else) per open #if
    let mut stack: Vec<(bool, bool)> = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let active = stack.iter().all(|(a, _)| *a);
        if let Some(cond) = t.strip_prefix("#if ") {
            let cond = cond.trim();
            let v = match cond.strip_prefix('!') {
                Some(c) => !flags.contains(&c),
                None => flags.contains(&cond),
            };
            stack.push((v, false));
        } else if t.starts_with("#else") {
            match stack.last_mut() {
                Some((v, seen)) if !*seen => {
                    *v = !*v;
                    *seen = true;
                }
                _ => return Err(Error::Gpu(format!("{name}.wgsl:{}: stray #else", n + 1))),
            }
        } else if t.starts_with("#endif") {
            if stack.pop().is_none() {
                return Err(Error::Gpu(format!("{name}.wgsl:{}: stray #endif", n + 1)));
            }
        } else if active && !line.starts_with("enable ") {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !stack.is_empty() {
        return Err(Error::Gpu(format!("{name}.wgsl: unterminated #if")));
    }
    Ok(out)
}

/// Expands the `#for VAR COUNT` … `#endfor` blocks of `lines` (nested ones too).
fn unroll(name: &str, lines: &[String], consts: &[(&str, Const)]) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(lines.len());
    let mut i = 0;
    while i < lines.len() {
        let Some(head) = lines[i].trim_start().strip_prefix("#for ") else {
            if lines[i].trim_start().starts_with("#endfor") {
                return Err(Error::Gpu(format!("{name}.wgsl: stray #endfor")));
            }
            out.push(lines[i].clone());
            i += 1;
            continue;
        };
        let mut words = head.split_whitespace();
        let (Some(var), Some(count), None) = (words.next(), words.next(), words.next()) else {
            return Err(Error::Gpu(format!(
                "{name}.wgsl: `#for {head}`: want #for VAR COUNT"
            )));
        };
        let count = match count.parse::<u32>() {
            Ok(n) => n,
            Err(_) => match consts.iter().find(|(k, _)| *k == count) {
                Some((_, Const::U32(n))) => *n,
                _ => {
                    return Err(Error::Gpu(format!(
                        "{name}.wgsl: `#for {head}`: {count} is no u32 constant"
                    )));
                }
            },
        };
        // The matching #endfor.
        let mut depth = 1;
        let mut end = i + 1;
        while end < lines.len() {
            let t = lines[end].trim_start();
            if t.starts_with("#for ") {
                depth += 1;
            } else if t.starts_with("#endfor") {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            end += 1;
        }
        if depth != 0 {
            return Err(Error::Gpu(format!("{name}.wgsl: unterminated #for {var}")));
        }
        let body = unroll(name, &lines[i + 1..end], consts)?;
        let key = format!("{{{var}}}");
        for k in 0..count {
            out.extend(body.iter().map(|l| l.replace(&key, &k.to_string())));
        }
        i = end + 1;
    }
    Ok(out)
}

/// Kernels whose fixed-size arrays (workgroup tiles) are indexed only through their tile
/// constants and invocation ids, checked by hand for every index: their clamps can go.
const FIXED_INDEX_KERNELS: [&str; 2] = ["gemm_coop", "ssd_chunk_scan_coop"];

/// The run-time checks compiled into kernel `name`. wgpu's default wraps every loop in a
/// 64-bit trip counter (`force_loop_bounding`, against loops a driver could assume
/// infinite), guards every integer division and clamps every index into a fixed-size
/// array. The kernels here are this crate's own: every loop counts a `u32` up to a constant
/// or a dispatch-time bound and every divisor is a constant, so the first two go everywhere
/// (the loop counters alone cost Codestral q8_0 decode 18 % on the H200, 4.35 → 3.68
/// ms/token, BENCHMARKS.md). Buffer bounds checks stay (on Vulkan the driver's robust
/// buffer access takes them), and so do the array clamps, except on Vulkan in
/// `FIXED_INDEX_KERNELS` (the tensor-core GEMM and chunk scan: 9 % of a long prompt).
/// `MAMBA2_SHADER_CHECKS=all | bounds | none` sets them for every kernel (for measuring).
pub fn runtime_checks(backend: wgpu::Backend, name: &str) -> wgpu::ShaderRuntimeChecks {
    match std::env::var("MAMBA2_SHADER_CHECKS").as_deref() {
        Ok("all") => wgpu::ShaderRuntimeChecks::checked(),
        Ok("bounds") => bounds_only(),
        Ok("none") => wgpu::ShaderRuntimeChecks::unchecked(),
        Ok(other) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!("MAMBA2_SHADER_CHECKS={other} ignored: want all, bounds or none")
            });
            default_checks(backend, name)
        }
        Err(_) => default_checks(backend, name),
    }
}

/// Bounds checks and array clamps, without loop counters or division guards.
fn bounds_only() -> wgpu::ShaderRuntimeChecks {
    wgpu::ShaderRuntimeChecks {
        force_loop_bounding: false,
        int_div_checks: false,
        ..wgpu::ShaderRuntimeChecks::checked()
    }
}

/// The checks a kernel gets without MAMBA2_SHADER_CHECKS (see `runtime_checks`).
fn default_checks(backend: wgpu::Backend, name: &str) -> wgpu::ShaderRuntimeChecks {
    if backend == wgpu::Backend::Vulkan && FIXED_INDEX_KERNELS.contains(&name) {
        wgpu::ShaderRuntimeChecks::unchecked()
    } else {
        bounds_only()
    }
}

/// MAMBA2_SHADER_DUMP=DIR: every kernel specialization a run compiles also goes to
/// `DIR/NAME-HASH.wgsl` (the text wgpu gets, after a first line naming the run-time
/// checks it is compiled with), for offline tools such as `examples/pipeline_stats.rs` (the
/// driver's register and spill counts per kernel). A file that cannot be written is
/// reported once and the run goes on.
fn dump(name: &str, text: &str, checks: &wgpu::ShaderRuntimeChecks) {
    let Some(dir) = std::env::var_os("MAMBA2_SHADER_DUMP") else {
        return;
    };
    if let Err(e) = dump_to(std::path::Path::new(&dir), name, text, checks) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!("MAMBA2_SHADER_DUMP={}: {e}", dir.to_string_lossy()));
    }
}

/// Writes one dumped kernel (see `dump`); returns its path.
fn dump_to(
    dir: &std::path::Path,
    name: &str,
    text: &str,
    checks: &wgpu::ShaderRuntimeChecks,
) -> std::io::Result<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    let path = dir.join(format!("{name}-{:016x}.wgsl", h.finish()));
    // The checks that change the SPIR-V a compute kernel gets, by name.
    let on: Vec<&str> = [
        (checks.bounds_checks, "bounds"),
        (checks.force_loop_bounding, "loops"),
        (checks.int_div_checks, "divisions"),
    ]
    .into_iter()
    .filter_map(|(on, what)| on.then_some(what))
    .collect();
    let checks = if on.is_empty() {
        "none".to_string()
    } else {
        on.join(" ")
    };
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        &path,
        format!("// mamba2 kernel {name}; checks: {checks}\n{text}"),
    )?;
    Ok(path)
}

/// Compiles a kernel into a compute pipeline (entry point `main`, layout from the shader).
pub fn pipeline(
    device: &wgpu::Device,
    name: &str,
    sources: &[&str],
    consts: &[(&str, Const)],
    flags: &[&str],
) -> Result<wgpu::ComputePipeline> {
    let text = assemble(name, sources, consts, flags)?;
    let checks = runtime_checks(device.adapter_info().backend, name);
    dump(name, &text, &checks);
    // One compile at a time in the process, whatever the device: with several devices
    // compiling at once (test threads), NVIDIA's driver (580) crashed or hung.
    static COMPILE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = COMPILE.lock().unwrap_or_else(|e| e.into_inner());
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(text.into()),
    };
    // SAFETY: `runtime_checks` says which checks go and why these kernels need none of them.
    let module = unsafe { device.create_shader_module_trusted(desc, checks) };
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &[],
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(Error::Gpu(format!(
            "kernel `{name}` failed to compile: {e}"
        )));
    }
    Ok(pipeline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dumped_kernel_is_its_text_after_a_header() {
        let dir = std::env::temp_dir().join(format!("mamba2-dump-{}", std::process::id()));
        let text = "@compute @workgroup_size(1)\nfn main() {}\n";
        let path = dump_to(&dir, "k", text, &bounds_only()).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("k-") && name.ends_with(".wgsl"), "{name}");
        let got = std::fs::read_to_string(&path).unwrap();
        assert_eq!(got, format!("// mamba2 kernel k; checks: bounds\n{text}"));
        // The same text lands in the same file; another in another.
        assert_eq!(dump_to(&dir, "k", text, &bounds_only()).unwrap(), path);
        for (body, checks, header) in [
            (
                "// other\n",
                wgpu::ShaderRuntimeChecks::checked(),
                "bounds loops divisions",
            ),
            ("// none\n", wgpu::ShaderRuntimeChecks::unchecked(), "none"),
        ] {
            let got = std::fs::read_to_string(dump_to(&dir, "k", body, &checks).unwrap()).unwrap();
            assert!(
                got.starts_with(&format!("// mamba2 kernel k; checks: {header}\n")),
                "{got}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loop_counters_go_everywhere_and_clamps_only_in_the_checked_kernels() {
        let vk = wgpu::Backend::Vulkan;
        let gemv = default_checks(vk, "gemv");
        assert!(gemv.bounds_checks && !gemv.force_loop_bounding && !gemv.int_div_checks);
        assert!(!default_checks(vk, "gemm_coop").bounds_checks);
        assert!(!default_checks(vk, "ssd_chunk_scan_coop").bounds_checks);
        // Elsewhere no driver bounds storage accesses: every kernel keeps its checks.
        assert!(default_checks(wgpu::Backend::Metal, "gemm_coop").bounds_checks);
    }

    #[test]
    fn flags_select_lines() {
        let src = "@a\n#if X\n@b\n#if !Y\n@c\n#else\n@d\n#endif\n#else\n@e\n#endif\n@f";
        let body = |flags: &[&str]| {
            let s = assemble("t", &[src], &[("Q", Const::U32(3))], flags).unwrap();
            assert!(s.starts_with("const Q: u32 = 3u;\n"));
            s.lines()
                .filter_map(|l| l.strip_prefix('@'))
                .collect::<String>()
        };
        assert_eq!(body(&["X"]), "abcf");
        assert_eq!(body(&["X", "Y"]), "abdf");
        assert_eq!(body(&[]), "aef");
        assert!(assemble("t", &["#if X\n"], &[], &[]).is_err());
        assert!(assemble("t", &["#endif\n"], &[], &[]).is_err());
    }

    #[test]
    fn for_blocks_repeat_with_the_index() {
        let src = "#for r R\n#for j 2\n@{r}{j}\n#endfor\n@{r}\n#endfor\n@end";
        let s = assemble("t", &[src], &[("R", Const::U32(3))], &[]).unwrap();
        let body: Vec<&str> = s.lines().filter_map(|l| l.strip_prefix('@')).collect();
        assert_eq!(
            body,
            ["00", "01", "0", "10", "11", "1", "20", "21", "2", "end"]
        );
        assert!(assemble("t", &["#for j 2\n"], &[], &[]).is_err());
        assert!(assemble("t", &["#endfor\n"], &[], &[]).is_err());
        assert!(assemble("t", &["#for j NOPE\n#endfor\n"], &[], &[]).is_err());
    }
}
