//! Opening the files a model directory (or a user) names, without trusting them: only
//! regular files are opened (a FIFO would block `open` forever, a device like `/dev/zero`
//! would be read forever), text is read up to a stated bound, and names taken from inside a
//! file (a shard index) stay inside the model directory.

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// The most a JSON file of a model directory may hold (configs, shard indexes, tokenizer
/// configs): the largest real ones are a few MiB.
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// The most `tokenizer.json` may hold (the largest real vocabularies are ~30 MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// The most a text input (a prompt or perplexity file) may hold.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Whether `path` names a regular file (following symlinks, as `open` would). Unlike
/// `Path::is_file` this says why not, for the caller's message.
pub fn check_regular(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        Ok(())
    } else {
        Err(not_regular(path, &meta, "read"))
    }
}

/// The refusal to `act` on `path`, which `meta` says is not a regular file.
fn not_regular(path: &Path, meta: &std::fs::Metadata, act: &str) -> Error {
    let what = if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file (a FIFO, socket or device?)"
    };
    Error::format(path, format!("is {what}: refusing to {act} it"))
}

/// The path a write that replaces `path` (a temporary file renamed over it) should
/// replace, refusing a device, FIFO, socket or directory: `path` itself when nothing is
/// there yet or it is a regular file. A symlink: with `follow`, its target (the link stays,
/// as a plain write through it keeps it; a dangling link's target is created), where the
/// target is a regular file or not there yet; without, the link itself (replaced, never
/// written through: what a directory of the engine's own files wants).
pub fn replaceable(path: &Path, follow: bool) -> Result<PathBuf> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.to_path_buf()),
        other => other.map_err(|e| Error::io(path, e))?,
    };
    if !meta.file_type().is_symlink() {
        return match meta.is_file() {
            true => Ok(path.to_path_buf()),
            false => Err(not_regular(path, &meta, "replace")),
        };
    }
    if !follow {
        return Ok(path.to_path_buf());
    }
    let link = std::fs::read_link(path).map_err(|e| Error::io(path, e))?;
    let target = path.parent().unwrap_or(Path::new("")).join(link);
    match std::fs::metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(target),
        Err(e) => Err(Error::io(&target, e)),
        Ok(m) if m.is_file() => Ok(target),
        Ok(m) => Err(not_regular(path, &m, "replace")),
    }
}

/// Opens `path` for reading if it is a regular file. The type is checked before `open`
/// (which blocks on a FIFO with no writer) and again on the open handle (the path may have
/// been swapped in between).
pub fn open_regular(path: &Path) -> Result<File> {
    check_regular(path)?;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::format(
            path,
            "is not a regular file: refusing to read it",
        ));
    }
    Ok(file)
}

/// The bytes of a regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let too_big = |n: u64| {
        Error::format(
            path,
            format!(
                "is {} large, over the {} this engine reads from such a file",
                human_bytes(n),
                human_bytes(limit)
            ),
        )
    };
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > limit {
        return Err(too_big(len));
    }
    let mut bytes = Vec::new();
    // `take` bounds the read even if the file grows after the size check.
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The UTF-8 text of a regular file of at most `limit` bytes.
pub fn read_text(path: &Path, limit: u64) -> Result<String> {
    let bytes = read_bounded(path, limit)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::format(
            path,
            format!(
                "is not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// `dir/name` for a file name read from inside the model (a shard index's `weight_map`),
/// refused unless it stays inside `dir`: a relative path of plain components only (no
/// `..`, no root, no drive). Symlinks inside the directory are followed as usual — the
/// Hugging Face cache links every file to a blob outside the snapshot directory.
pub fn confined(dir: &Path, name: &str) -> std::result::Result<PathBuf, String> {
    let rel = Path::new(name);
    if name.is_empty() {
        return Err("is empty".into());
    }
    if let Some(bad) = rel
        .components()
        .find(|c| !matches!(c, Component::Normal(_)))
    {
        let why = match bad {
            Component::ParentDir => "`..` leaves the model directory",
            Component::CurDir => "`.` components are not allowed",
            _ => "an absolute path leaves the model directory",
        };
        return Err(format!("`{name}`: {why}"));
    }
    Ok(dir.join(rel))
}

/// `n` bytes in the largest binary unit that keeps it ≥ 1.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_stay_inside_the_directory() {
        let dir = Path::new("/models/m");
        assert_eq!(
            confined(dir, "model-00001-of-00002.safetensors").unwrap(),
            dir.join("model-00001-of-00002.safetensors")
        );
        assert_eq!(
            confined(dir, "sub/part.safetensors").unwrap(),
            dir.join("sub/part.safetensors")
        );
        for bad in [
            "../other/model.safetensors",
            "/etc/passwd",
            "a/../../b",
            "./x",
            "",
        ] {
            assert!(confined(dir, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bounded_reads_refuse_devices_and_big_files() {
        let e = read_text(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = read_text(Path::new("/"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let path = std::env::temp_dir().join(format!("mamba2-files-{}", std::process::id()));
        std::fs::write(&path, vec![b'a'; 100]).unwrap();
        assert_eq!(read_text(&path, 100).unwrap().len(), 100);
        let e = read_text(&path, 99).unwrap_err();
        assert!(e.to_string().contains("over the 99 B"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }
}
