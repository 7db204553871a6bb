//! Secrets (API keys, broker tokens, gateway tokens): read from the environment or a file,
//! never from the command line, and never printed.
//!
//! [`Secret`]'s `Debug` and `Display` print a placeholder, so a secret inside a config
//! struct that gets logged stays hidden. Errors name the variable or file that holds a
//! secret, never its value.

use std::{fmt, path::PathBuf};

/// A secret string. Only [`Secret::expose`] reveals it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Reads the secret named `var`: from the environment variable `var`, or from the file
    /// named by `var_FILE` (Kubernetes Secrets mounted as files). `Ok(None)` when neither is set.
    pub fn from_env(var: &str) -> Result<Option<Secret>, SecretError> {
        let file_var = format!("{var}_FILE");
        if let Some(path) = std::env::var_os(&file_var) {
            let path = PathBuf::from(path);
            let text = std::fs::read_to_string(&path).map_err(|e| SecretError::File {
                var: file_var.clone(),
                path: path.clone(),
                reason: e.to_string(),
            })?;
            let value = text.trim();
            if value.is_empty() {
                return Err(SecretError::Empty {
                    origin: format!("{file_var} ({})", path.display()),
                });
            }
            return Ok(Some(Secret::new(value)));
        }
        match std::env::var(var) {
            Ok(v) if v.trim().is_empty() => Err(SecretError::Empty {
                origin: var.to_owned(),
            }),
            Ok(v) => Ok(Some(Secret::new(v.trim()))),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(SecretError::NotUnicode {
                var: var.to_owned(),
            }),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A secret that is configured but cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file named by a `*_FILE` variable cannot be read.
    #[error("cannot read the secret file {path:?} named by {var}: {reason}")]
    File {
        /// The variable naming the file.
        var: String,
        /// The file.
        path: PathBuf,
        /// Why it cannot be read.
        reason: String,
    },
    /// The secret is set but empty.
    #[error("the secret in {origin} is empty")]
    Empty {
        /// Where it was read from.
        origin: String,
    },
    /// The variable is not valid UTF-8.
    #[error("the secret in {var} is not valid UTF-8")]
    NotUnicode {
        /// The variable.
        var: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-very-secret");
        assert!(!format!("{s:?} {s}").contains("very-secret"));
        assert_eq!(s.expose(), "sk-very-secret");
    }

    #[test]
    fn a_file_variable_wins_and_errors_name_the_file_not_the_value() {
        let dir = std::env::temp_dir().join(format!("sluice-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        // SAFETY-free: these variable names are unique to this test.
        unsafe_env::set("SLUICE_TEST_SECRET_A_FILE", path.to_str().unwrap());
        let s = Secret::from_env("SLUICE_TEST_SECRET_A").unwrap().unwrap();
        assert_eq!(s.expose(), "from-file");
        unsafe_env::set("SLUICE_TEST_SECRET_B_FILE", "/nonexistent/sluice/token");
        let err = Secret::from_env("SLUICE_TEST_SECRET_B")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("SLUICE_TEST_SECRET_B_FILE") && err.contains("/nonexistent/sluice/token")
        );
        assert!(
            Secret::from_env("SLUICE_TEST_SECRET_UNSET")
                .unwrap()
                .is_none()
        );
    }

    mod unsafe_env {
        pub fn set(key: &str, value: &str) {
            // Edition 2024 makes set_var unsafe because other threads may read the
            // environment concurrently; these keys are read by this test alone.
            #[allow(unsafe_code)]
            unsafe {
                std::env::set_var(key, value)
            };
        }
    }
}
