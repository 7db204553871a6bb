//! Seals: HMAC-SHA256 tags that let processes sharing a secret trust what another of them
//! wrote (a gateway replica's resume token, its limit snapshots on the bus), so that what
//! anyone else writes is refused.
//!
//! One primitive for every such use. Each use names its own [`Label`], which is part of what
//! is tagged: a tag made for one use never verifies for another (a resume token's tag is not a
//! limit snapshot's). What is sealed is a list of parts, each length-prefixed, so that two
//! different lists never read as the same bytes (`["ab", "c"]` is not `["a", "bc"]`).
//!
//! A seal proves who wrote something and that it was not changed, not that it is new: a
//! sealed message can be replayed as it is, and the reader must judge that (an age, a
//! sequence number). This module must never log, print or return the secret.

use std::{fmt, sync::Arc};

use base64::Engine as _;
use hmac::{Hmac, Mac, digest::KeyInit};
use sha2::{Digest, Sha256};

use crate::secret::{Secret, SecretError};

type HmacSha256 = Hmac<Sha256>;

/// The shortest secret accepted, in bytes: 256 bits of a random hex or base64 string are
/// far more than enough, and a short one could be guessed from one sealed message offline.
pub const MIN_SECRET_LEN: usize = 32;

/// The shortest tag [`SealKey::verify`] accepts, in bytes (128 bits, as RFC 2104 allows
/// truncating to): a shorter one would be easier to guess.
pub const MIN_TAG_LEN: usize = 16;

/// What a seal is for; part of what is tagged. One per use, never shared between uses, and
/// changed when the sealed parts change meaning (a version at its end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label(&'static str);

impl Label {
    /// A label; e.g. `Label::new("sluice/gateway/resume-token/v2")`.
    pub const fn new(name: &'static str) -> Self {
        Self(name)
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.0
    }
}

/// Where a key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// Configured: other processes given the same secret trust its seals.
    Configured,
    /// Made at random by this process: only this process trusts its seals.
    Random,
}

/// A key that seals and verifies. Cheap to clone. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct SealKey {
    /// HMAC keyed once; cloned for each seal.
    keyed: Arc<HmacSha256>,
    origin: Origin,
}

/// A secret that cannot be a key.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The secret could not be read.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The secret is too short to be safe.
    #[error(
        "the secret in {origin} is {len} bytes long; at least {MIN_SECRET_LEN} are needed (`openssl rand -hex 32` makes one)"
    )]
    TooShort {
        /// Where it was read from.
        origin: String,
        /// Its length.
        len: usize,
    },
}

/// A tag made by [`SealKey::seal`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Seal([u8; 32]);

impl Seal {
    /// The whole tag.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The tag's first `len` bytes (at least [`MIN_TAG_LEN`], at most 32), as URL-safe
    /// base64 without padding: no dots, slashes or plus signs, so it fits in a header, a
    /// dotted token or a message property.
    pub fn encode(&self, len: usize) -> String {
        let len = len.clamp(MIN_TAG_LEN, self.0.len());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&self.0[..len])
    }
}

impl fmt::Debug for Seal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Seal(..)")
    }
}

impl SealKey {
    /// A key of `secret`, which other processes may be given too.
    pub fn new(secret: &Secret, origin: &str) -> Result<Self, SealError> {
        let bytes = secret.expose().as_bytes();
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SealError::TooShort {
                origin: origin.to_owned(),
                len: bytes.len(),
            });
        }
        Ok(Self {
            keyed: Arc::new(keyed(bytes)),
            origin: Origin::Configured,
        })
    }

    /// A random key of this process alone: its seals verify nowhere else. What a process
    /// uses when no secret is configured.
    pub fn random() -> Self {
        let key: [u8; 32] = rand::random();
        Self {
            keyed: Arc::new(keyed(&key)),
            origin: Origin::Random,
        }
    }

    /// The key of the secret named `var` (from `var`, or the file named by `var_FILE`; see
    /// [`Secret::from_env`]). `Ok(None)` when neither is set, or `var` is set but empty (a
    /// compose file's `VAR=` passes it so); an empty file is an error, as a named file is a
    /// deliberate choice.
    pub fn from_env(var: &str) -> Result<Option<Self>, SealError> {
        let file_var = format!("{var}_FILE");
        let file_set = std::env::var_os(&file_var).is_some_and(|v| !v.is_empty());
        if !file_set && std::env::var(var).is_ok_and(|v| v.trim().is_empty()) {
            return Ok(None);
        }
        let origin = if file_set { file_var } else { var.to_owned() };
        match Secret::from_env(var)? {
            Some(secret) => Self::new(&secret, &origin).map(Some),
            None => Ok(None),
        }
    }

    /// Whether the key was configured, so that other processes given the same secret trust
    /// its seals (else it is [`SealKey::random`]).
    pub fn is_shared(&self) -> bool {
        self.origin == Origin::Configured
    }

    fn mac(&self, label: Label, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = (*self.keyed).clone();
        for part in std::iter::once(label.0.as_bytes()).chain(parts.iter().copied()) {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        mac
    }

    /// The tag of `parts` under `label`.
    pub fn seal(&self, label: Label, parts: &[&[u8]]) -> Seal {
        Seal(self.mac(label, parts).finalize().into_bytes().into())
    }

    /// Whether `tag` (the whole tag, or its first bytes: at least [`MIN_TAG_LEN`]) is the
    /// tag of `parts` under `label`. Compared in constant time.
    pub fn verify(&self, label: Label, parts: &[&[u8]], tag: &[u8]) -> bool {
        if tag.len() < MIN_TAG_LEN || tag.len() > 32 {
            return false;
        }
        self.mac(label, parts).verify_truncated_left(tag).is_ok()
    }

    /// [`SealKey::verify`] of a tag as [`Seal::encode`] wrote it.
    pub fn verify_encoded(&self, label: Label, parts: &[&[u8]], tag: &str) -> bool {
        match base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(tag) {
            Ok(tag) => self.verify(label, parts, &tag),
            Err(_) => false,
        }
    }
}

/// HMAC-SHA256 keyed with `key`, as RFC 2104 prepares a key: hashed when longer than a
/// block, then padded with zeros to one (the same MAC as `Hmac::new_from_slice`, without its
/// `Result`, which no key length fails).
fn keyed(key: &[u8]) -> HmacSha256 {
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    <HmacSha256 as KeyInit>::new(&block.into())
}

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealKey")
            .field("key", &"<redacted>")
            .field("shared", &self.is_shared())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Label = Label::new("test/a/v1");
    const B: Label = Label::new("test/b/v1");

    fn key(s: &str) -> SealKey {
        SealKey::new(&Secret::new(s), "test").unwrap()
    }

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn a_seal_verifies_only_the_same_parts_under_the_same_label_and_key() {
        let k = key(SECRET);
        let tag = k.seal(A, &[b"one", b"two"]);
        assert!(k.verify(A, &[b"one", b"two"], tag.as_bytes()));
        // Another label: a tag made for one use is no good for another.
        assert!(!k.verify(B, &[b"one", b"two"], tag.as_bytes()));
        // The same bytes cut otherwise.
        assert!(!k.verify(A, &[b"on", b"etwo"], tag.as_bytes()));
        assert!(!k.verify(A, &[b"onetwo"], tag.as_bytes()));
        assert!(!k.verify(A, &[b"one", b"two", b""], tag.as_bytes()));
        // One bit changed.
        assert!(!k.verify(A, &[b"one", b"twp"], tag.as_bytes()));
        let mut bad = *tag.as_bytes();
        bad[31] ^= 1;
        assert!(!k.verify(A, &[b"one", b"two"], &bad));
        // Another key.
        let other = key("fedcba9876543210fedcba9876543210");
        assert!(!other.verify(A, &[b"one", b"two"], tag.as_bytes()));
        // Keys of the same secret agree: what replicas given one secret rely on.
        assert!(key(SECRET).verify(A, &[b"one", b"two"], tag.as_bytes()));
    }

    #[test]
    fn the_key_is_prepared_as_hmac_itself_does() {
        for len in [32, 64, 65, 200] {
            let secret = "k".repeat(len);
            let ours = key(&secret).seal(A, &[b"x"]);
            let mut theirs = <HmacSha256 as Mac>::new_from_slice(secret.as_bytes()).unwrap();
            for part in [A.name().as_bytes(), b"x"] {
                theirs.update(&(part.len() as u64).to_be_bytes());
                theirs.update(part);
            }
            let theirs: [u8; 32] = theirs.finalize().into_bytes().into();
            assert_eq!(ours.as_bytes(), &theirs, "{len}");
        }
    }

    #[test]
    fn a_tag_may_be_cut_to_128_bits_and_no_shorter() {
        let k = key(SECRET);
        let tag = k.seal(A, &[b"x"]);
        assert!(k.verify(A, &[b"x"], &tag.as_bytes()[..16]));
        assert!(!k.verify(A, &[b"x"], &tag.as_bytes()[..15]));
        assert!(!k.verify(A, &[b"x"], &[]));
        // The tag's last bytes are not its first.
        assert!(!k.verify(A, &[b"x"], &tag.as_bytes()[16..]));
        let text = tag.encode(16);
        assert_eq!(text.len(), 22);
        assert!(
            text.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert!(k.verify_encoded(A, &[b"x"], &text));
        assert!(!k.verify_encoded(A, &[b"y"], &text));
        assert!(!k.verify_encoded(A, &[b"x"], "not base64!"));
        assert!(k.verify_encoded(A, &[b"x"], &tag.encode(32)));
    }

    #[test]
    fn a_random_key_is_this_process_alone() {
        let (a, b) = (SealKey::random(), SealKey::random());
        assert!(!a.is_shared());
        assert!(key(SECRET).is_shared());
        let tag = a.seal(A, &[b"x"]);
        assert!(a.verify(A, &[b"x"], tag.as_bytes()));
        assert!(!b.verify(A, &[b"x"], tag.as_bytes()));
    }

    #[test]
    fn a_short_secret_is_refused_and_the_key_never_prints() {
        let e = SealKey::new(&Secret::new("short"), "SLUICE_X")
            .unwrap_err()
            .to_string();
        assert!(e.contains("SLUICE_X") && e.contains("at least 32"), "{e}");
        assert!(!e.contains("short\""), "{e}");
        let printed = format!("{:?} {:?}", key(SECRET), key(SECRET).seal(A, &[]));
        assert!(!printed.contains(SECRET), "{printed}");
    }

    #[test]
    fn from_env_reads_the_variable_or_its_file_and_an_empty_variable_is_unset() {
        // These variable names are used by this test alone.
        set("SLUICE_TEST_SEAL_EMPTY", "  ");
        assert!(
            SealKey::from_env("SLUICE_TEST_SEAL_EMPTY")
                .unwrap()
                .is_none()
        );
        assert!(
            SealKey::from_env("SLUICE_TEST_SEAL_UNSET")
                .unwrap()
                .is_none()
        );
        set("SLUICE_TEST_SEAL_SET", SECRET);
        let k = SealKey::from_env("SLUICE_TEST_SEAL_SET").unwrap().unwrap();
        assert!(k.is_shared());
        assert!(k.verify(A, &[], key(SECRET).seal(A, &[]).as_bytes()));
        set("SLUICE_TEST_SEAL_SHORT", "abc");
        let e = SealKey::from_env("SLUICE_TEST_SEAL_SHORT")
            .unwrap_err()
            .to_string();
        assert!(e.contains("SLUICE_TEST_SEAL_SHORT"), "{e}");
        let dir = std::env::temp_dir().join(format!("sluice-seal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, format!("{SECRET}\n")).unwrap();
        set("SLUICE_TEST_SEAL_F_FILE", path.to_str().unwrap());
        let k = SealKey::from_env("SLUICE_TEST_SEAL_F").unwrap().unwrap();
        assert!(k.verify(A, &[], key(SECRET).seal(A, &[]).as_bytes()));
        // An empty file is a mistake, not "unset".
        std::fs::write(&path, "\n").unwrap();
        assert!(SealKey::from_env("SLUICE_TEST_SEAL_F").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn set(key: &str, value: &str) {
        // Edition 2024 makes set_var unsafe because other threads may read the environment
        // concurrently; these keys are read by one test alone.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var(key, value)
        };
    }
}
