//! API keys files for the tests that start a gateway with `--keys-file` or
//! `Auth::with_keys`: written as the gateway's operators write them (a key's SHA-256, never the
//! key), in a directory of their own that goes with them.

use std::path::{Path, PathBuf};

/// One key of a keys file: its name, the key a caller sends, and any further TOML lines
/// (limits, `services = [...]`).
pub type KeyEntry<'a> = (&'a str, &'a str, &'a str);

/// The text of a keys file holding `entries`.
pub fn keys_toml(entries: &[KeyEntry<'_>]) -> String {
    entries
        .iter()
        .map(|(name, key, rest)| {
            format!(
                "[[keys]]\nname = \"{name}\"\nsha256 = \"{}\"\n{rest}\n",
                sluice_gateway::keys::hash_hex(key)
            )
        })
        .collect()
}

/// A keys file in a new directory, removed with it.
pub struct KeysFile {
    dir: PathBuf,
    path: PathBuf,
}

impl KeysFile {
    /// A keys file holding `entries`.
    pub fn new(entries: &[KeyEntry<'_>]) -> KeysFile {
        let dir = std::env::temp_dir().join(format!("sluice-keys-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = KeysFile {
            path: dir.join("keys.toml"),
            dir,
        };
        file.write(entries);
        file
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its path as text, for a command line.
    pub fn arg(&self) -> String {
        self.path.display().to_string()
    }

    /// Replaces what it holds with `entries` as a Kubernetes Secret volume changes: a new file
    /// renamed over the old, so a reader never sees half of it.
    pub fn write(&self, entries: &[KeyEntry<'_>]) {
        self.write_text(&keys_toml(entries));
    }

    /// Replaces its text with `text` (a broken file, say) as [`KeysFile::write`] does.
    pub fn write_text(&self, text: &str) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }

    /// The keys it holds, loaded as the gateway loads them.
    pub fn load(&self) -> sluice_gateway::keys::Keys {
        sluice_gateway::keys::Keys::load(&self.path).unwrap()
    }
}

impl Drop for KeysFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
