//! The agent's records in its state directory (`state.json`, `override.json`): small files
//! replaced whole and read whole, whatever sits at their path.
//!
//! [`replace`] writes a temporary file beside the record with the mode the caller names (not
//! whatever the umask leaves), syncs it and renames it over the record: a reader sees the old
//! record or the new one, never half of one, and a crash or a power loss right after the rename
//! cannot leave a record that is empty because its data never reached the disk (without the
//! sync, XFS, or ext4 mounted `noauto_da_alloc`, may).
//!
//! [`read`] returns at once, with bounded memory, whatever is there: the file is opened without
//! blocking (a FIFO in its place would otherwise hold the reader until someone writes to it),
//! only a regular file is read, and only up to the caller's limit (a device such as `/dev/zero`
//! linked there never ends).

use std::fs::{File, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Opening or reading it failed, or what is there is not a regular file (a directory, a
    /// FIFO, a device).
    #[error(transparent)]
    Io(#[from] io::Error),
    /// It is larger than the reader's limit: not a record this agent wrote.
    #[error("larger than {limit} bytes")]
    TooLarge { limit: u64 },
}

/// Reads the regular file at `path` whole, if it holds at most `limit` bytes; `None` when there
/// is nothing at `path`.
pub fn read(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, ReadError> {
    let file = match File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        let what = if meta.is_dir() { "a directory" } else { "not a regular file" };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, what).into());
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge { limit });
    }
    Ok(Some(bytes))
}

/// Replaces the file at `path` with `bytes`, mode `mode`, atomically (see the module's notes).
///
/// The temporary file is `.<name>.tmp` in the same directory. One left behind by a writer that
/// died is removed first, whatever it is: the new one is created afresh (`O_EXCL`), so it is
/// never a FIFO that would block the write, nor a file that keeps a mode of its own.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let tmp = temporary(path);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = File::options()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp)?;
    // The umask applied to the mode at creation; this sets it as asked.
    let written = file
        .set_permissions(Permissions::from_mode(mode))
        .and_then(|()| file.write_all(bytes))
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `<dir>/.<name>.tmp` for `<dir>/<name>`.
fn temporary(path: &Path) -> PathBuf {
    let name = path.file_name().map_or_else(Default::default, |n| n.to_string_lossy());
    path.with_file_name(format!(".{name}.tmp"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// An empty directory of the test's own, named by `tag`.
    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nlha-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn replaces_whole_with_the_mode_asked_not_the_umasks() {
        let dir = scratch("replace");
        let path = dir.join("record.json");
        // A temporary file left behind, of another mode: replaced, not reused.
        let tmp = temporary(&path);
        assert_eq!(tmp, dir.join(".record.json.tmp"));
        std::fs::write(&tmp, b"left behind, longer than what comes").unwrap();
        std::fs::set_permissions(&tmp, Permissions::from_mode(0o600)).unwrap();
        // Group- and world-writable: what a umask (022 as a rule) takes away at creation.
        replace(&path, b"first", 0o666).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(mode(&path), 0o666);
        assert!(!tmp.exists());
        replace(&path, b"second", 0o600).unwrap();
        assert_eq!(read(&path, 64).unwrap().unwrap(), b"second");
        assert_eq!(mode(&path), 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_left_as_the_temporary_file_does_not_block_the_writer() {
        let dir = scratch("tmp-fifo");
        let path = dir.join("record.json");
        nix::unistd::mkfifo(&temporary(&path), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        replace(&path, b"{}", 0o644).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_a_regular_file_up_to_its_limit_and_nothing_else() {
        let dir = scratch("read");
        let path = dir.join("record.json");
        assert!(read(&path, 4).unwrap().is_none());
        std::fs::write(&path, b"1234").unwrap();
        assert_eq!(read(&path, 4).unwrap().unwrap(), b"1234");
        let err = read(&path, 3).unwrap_err();
        assert!(matches!(err, ReadError::TooLarge { limit: 3 }), "{err:?}");
        assert_eq!(err.to_string(), "larger than 3 bytes");

        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert_eq!(read(&path, 4).unwrap_err().to_string(), "a directory");
        std::fs::remove_dir(&path).unwrap();
        // A plain open would wait for a writer; refused at once.
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(read(&path, 4).unwrap_err().to_string(), "not a regular file");
        std::fs::remove_file(&path).unwrap();
        // Never ends; refused before a byte is read.
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert_eq!(read(&path, 4).unwrap_err().to_string(), "not a regular file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
