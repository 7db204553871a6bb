//! The billing seal: proof, on a request, that the gateway admitted it under the API key its
//! [`properties::KEY`] names, so that the text-completion processor bills usage to that key
//! only when the gateway said so (docs/security.md#the-key-that-bills-usage).
//!
//! Without it, whoever may publish a request can name any key and bill its usage there. The
//! gateway seals the key's name together with the request's id ([`KEY_SEAL`]'s value carries
//! the id) with a secret it shares with text-completion alone (`SLUICE_BILLING_SECRET`): a
//! seal made for one key never verifies for another, and one made for one request names that
//! request. The prompt and agent processors, clients of text-completion on their caller's
//! behalf, forward the key and its seal as they received them: they never hold the secret,
//! so they can pass on the key of a request they handle but cannot make a seal for any other.
//!
//! What a seal cannot do: tell who published a request. A processor that relays (prompt,
//! agent) may reuse the seal of a request it handles on as many text-completion requests as
//! it likes; that is what forwarding is. Producing requests stays the roles' business
//! (docs/production-pulsar.md#roles-and-grants).
//!
//! This module never logs, and never puts the secret into what it returns.

use sluice_schema::properties;

use crate::seal::{Label, SealError, SealKey};

/// The seal of a key's name and a request id; its own label, never another use's.
pub const LABEL: Label = Label::new("sluice/billing/key/v1");

/// The variable (or `_FILE`) that holds the billing secret, shared by the gateway and the
/// text-completion processor only.
pub const SECRET_VAR: &str = "SLUICE_BILLING_SECRET";

/// The message property that carries a key's seal: `<tag>:<request id>`, the id of the
/// request the gateway sealed it for (the same request, or the one a relaying processor is
/// answering).
pub const KEY_SEAL: &str = properties::KEY_SEAL;

/// How many bytes of the HMAC a seal keeps: 128 bits, as many as the shortest tag a
/// [`SealKey`] verifies.
const TAG_LEN: usize = 16;

/// Why a key is not believed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unverified {
    /// The request names a key and carries no seal.
    Unsealed,
    /// The seal is not the billing secret's seal of this key's name.
    BadSeal,
}

impl Unverified {
    /// Its label value in `sluice_processor_unverified_keys_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unverified::Unsealed => "unsealed",
            Unverified::BadSeal => "bad-seal",
        }
    }
}

/// The billing secret's key, when `SLUICE_BILLING_SECRET` (or its `_FILE`) is set.
pub fn key_from_env() -> Result<Option<SealKey>, SealError> {
    SealKey::from_env(SECRET_VAR)
}

/// [`KEY_SEAL`]'s value for key `name` on request `request_id`.
pub fn seal(key: &SealKey, name: &str, request_id: &str) -> String {
    let tag = key.seal(LABEL, &[name.as_bytes(), request_id.as_bytes()]);
    format!("{}:{request_id}", tag.encode(TAG_LEN))
}

/// Whether `sealed` (a [`KEY_SEAL`] value, if the request carried one) is `key`'s seal of the
/// key `name`.
pub fn verify(key: &SealKey, name: &str, sealed: Option<&str>) -> Result<(), Unverified> {
    let sealed = sealed.ok_or(Unverified::Unsealed)?;
    // The tag is URL-safe base64: no `:` in it, so the first one ends it.
    let (tag, request_id) = sealed.split_once(':').ok_or(Unverified::BadSeal)?;
    if key.verify_encoded(LABEL, &[name.as_bytes(), request_id.as_bytes()], tag) {
        Ok(())
    } else {
        Err(Unverified::BadSeal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Secret;

    fn key(secret: &str) -> SealKey {
        SealKey::new(&Secret::new(secret), "test").unwrap()
    }

    const SECRET: &str = "billing-secret-0123456789abcdef0123";

    #[test]
    fn a_seal_verifies_for_its_key_name_only_and_names_its_request() {
        let k = key(SECRET);
        let sealed = seal(&k, "team-a", "req-1");
        assert!(sealed.ends_with(":req-1"), "{sealed}");
        assert_eq!(verify(&k, "team-a", Some(&sealed)), Ok(()));
        // Another key's name, the same seal: refused.
        assert_eq!(
            verify(&k, "team-b", Some(&sealed)),
            Err(Unverified::BadSeal)
        );
        // The seal moved to another request id: refused.
        let moved = sealed.replace(":req-1", ":req-2");
        assert_eq!(verify(&k, "team-a", Some(&moved)), Err(Unverified::BadSeal));
        // Another secret's seal (a gateway with a different one): refused.
        let other = seal(
            &key("another-secret-0123456789abcdef0123"),
            "team-a",
            "req-1",
        );
        assert_eq!(verify(&k, "team-a", Some(&other)), Err(Unverified::BadSeal));
        // None, garbage, or a tag cut short.
        assert_eq!(verify(&k, "team-a", None), Err(Unverified::Unsealed));
        for bad in ["", ":", "no-colon", "!!!:req-1", &sealed[4..]] {
            assert_eq!(
                verify(&k, "team-a", Some(bad)),
                Err(Unverified::BadSeal),
                "{bad}"
            );
        }
        // An id with colons of its own stays whole.
        let odd = seal(&k, "team-a", "a:b:c");
        assert_eq!(verify(&k, "team-a", Some(&odd)), Ok(()));
    }

    #[test]
    fn a_billing_seal_is_not_any_other_seal_of_the_same_secret() {
        let k = key(SECRET);
        let other_use = Label::new("sluice/gateway/resume-token/v2");
        let tag = k
            .seal(other_use, &[b"team-a".as_slice(), b"req-1".as_slice()])
            .encode(TAG_LEN);
        assert_eq!(
            verify(&k, "team-a", Some(&format!("{tag}:req-1"))),
            Err(Unverified::BadSeal)
        );
        assert!(!seal(&k, "team-a", "req-1").contains(SECRET));
    }
}
