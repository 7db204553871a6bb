//! Retry policies for provider calls, written as one line of text everywhere they are set:
//! the text-completion processor's `--retry` option, a prompt template's `retry` key, and a
//! text-completion request's `retry` field (docs/protocol.md#retries-and-timeouts).
//!
//! The line is a preset name, settings, or a preset followed by settings, separated by
//! commas: `seed-002`, `attempts=2,delay=2s`, `default,on=connect+timeout+503`. A setting not
//! named keeps the value of what it is applied to (the preset named first, else the policy
//! in force: the processor's own for a request or a template).
//!
//! Pure data like the rest of this crate: the text-completion processor decides, from a
//! failure and a policy, whether and when to try again.

use std::{fmt, time::Duration};

/// The most attempts a policy may make (the first included): more would hold a request for
/// minutes while the provider is down.
pub const MAX_ATTEMPTS: u32 = 10;

/// The longest delay a policy may ask for.
pub const MAX_DELAY: Duration = Duration::from_secs(300);

/// Why a retry policy's text was refused. Each names the preset or setting at fault and what
/// is allowed, never more of the text than that item.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RetrySpecError {
    /// A preset after a setting: presets replace the whole policy, so one must come first.
    #[error("the preset {0:?} must come first")]
    PresetNotFirst(String),
    /// No preset of that name.
    #[error("unknown retry preset {0:?}; the presets are: {presets}", presets = PRESETS.join(", "))]
    UnknownPreset(String),
    /// No setting of that name.
    #[error(
        "unknown retry setting {0:?}; the settings are: attempts, delay, factor, max-delay, jitter, on, hints"
    )]
    UnknownSetting(String),
    /// A setting's value that is not of its kind.
    #[error("retry setting {key}={value:?}: {problem}")]
    BadValue {
        /// The setting.
        key: String,
        /// Its value as given.
        value: String,
        /// What is wrong and what is allowed.
        problem: ValueProblem,
    },
    /// Attempts outside 1 to [`MAX_ATTEMPTS`].
    #[error("retry attempts must be 1 to {MAX_ATTEMPTS} (the first attempt included), not {0}")]
    Attempts(u32),
    /// A delay over [`MAX_DELAY`].
    #[error("a retry delay may be at most {} s", MAX_DELAY.as_secs())]
    Delay,
    /// A factor outside 1 to 10.
    #[error("the retry factor must be 1 to 10, not {0}")]
    Factor(f64),
    /// A jitter outside 0 to 1.
    #[error("the retry jitter must be 0 to 1, not {0}")]
    Jitter(f64),
}

/// What is wrong with one setting's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueProblem {
    /// `attempts` is not a whole number.
    #[error("not a whole number of attempts")]
    NotWhole,
    /// `factor` or `jitter` is not a number.
    #[error("not a number")]
    NotANumber,
    /// A duration without its unit.
    #[error("give a unit: 250ms or 2s")]
    NoUnit,
    /// A duration whose number does not parse.
    #[error("not a duration (250ms, 2s)")]
    NotADuration,
    /// A duration over [`MAX_DELAY`] or negative.
    #[error("must be 0 to {} s", MAX_DELAY.as_secs())]
    DurationRange,
    /// `hints` is not `true` or `false`.
    #[error("use true or false")]
    NotABool,
    /// A word of `on` that names no failure.
    #[error(
        "unknown failure {0:?}: use connect, timeout, an HTTP status from 400 to 599, 4xx or 5xx"
    )]
    UnknownFailure(String),
}

/// A failure that a policy retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOn {
    /// The connection could not be made (refused, unreachable, connect timeout).
    Connect,
    /// A time limit passed: no response headers or first token in time, or a stall between
    /// chunks.
    Timeout,
    /// One HTTP status, e.g. `503`. A provider's throttling counts as 429 whatever status it
    /// came with (Bedrock's `ThrottlingException`).
    Status(u16),
    /// A class of HTTP statuses: `5` for `5xx`, `4` for `4xx`.
    Class(u8),
}

impl RetryOn {
    fn parse(word: &str) -> Result<Self, ValueProblem> {
        match word {
            "connect" => Ok(Self::Connect),
            "timeout" => Ok(Self::Timeout),
            "4xx" => Ok(Self::Class(4)),
            "5xx" => Ok(Self::Class(5)),
            w => match w.parse::<u16>() {
                Ok(code) if (400..=599).contains(&code) => Ok(Self::Status(code)),
                _ => Err(ValueProblem::UnknownFailure(w.to_owned())),
            },
        }
    }
}

impl fmt::Display for RetryOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connect => f.write_str("connect"),
            Self::Timeout => f.write_str("timeout"),
            Self::Status(code) => write!(f, "{code}"),
            Self::Class(c) => write!(f, "{c}xx"),
        }
    }
}

/// How often and how long to retry a provider call that failed before the first record of
/// its answer was published.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 = no retry).
    pub attempts: u32,
    /// The delay before the first retry.
    pub delay: Duration,
    /// Each further delay is the one before times this (1 = the same delay every time).
    pub factor: f64,
    /// The cap on computed delays.
    pub max_delay: Duration,
    /// The share of a delay drawn at random (0 to 1): the wait is between
    /// `delay × (1 - jitter)` and `delay`, so a fleet of replicas does not retry in lockstep.
    pub jitter: f64,
    /// The failures retried; any other is final.
    pub on: Vec<RetryOn>,
    /// Whether the server's hints are followed: `retry-after(-ms)` as the delay (when at most
    /// 60 s), and `x-should-retry: true|false` deciding instead of `on`, as the providers'
    /// SDKs do.
    pub hints: bool,
}

/// The presets, by name: sluice's default and each application spec's policy.
const PRESETS: [&str; 5] = ["default", "sluice", "seed-000", "seed-001", "seed-002"];

impl Default for RetryPolicy {
    /// The providers' SDKs' policy: two retries at 0.5 s × 2^n (capped at 8 s) with 25%
    /// jitter, on connection errors, timeouts, 408, 409, 429 and 5xx, hints followed.
    fn default() -> Self {
        Self {
            attempts: 3,
            delay: Duration::from_millis(500),
            factor: 2.0,
            max_delay: Duration::from_secs(8),
            jitter: 0.25,
            on: vec![
                RetryOn::Connect,
                RetryOn::Timeout,
                RetryOn::Status(408),
                RetryOn::Status(409),
                RetryOn::Status(429),
                RetryOn::Class(5),
            ],
            hints: true,
        }
    }
}

impl RetryPolicy {
    /// The preset called `name`:
    /// - `default` (also `sluice`): [`RetryPolicy::default`];
    /// - `seed-000` and `seed-001`: one retry after 2 s, on connection errors and timeouts
    ///   only; every HTTP error (401, 429, 500, 503...) is final;
    /// - `seed-002`: three retries at 1 s, 2 s, 4 s, on connection errors, timeouts, 502, 503
    ///   and 504 (its §4.4; the code sample in its §4.2 makes 3 attempts in all, which is
    ///   `seed-002,attempts=3`).
    ///
    /// The structured contracts' policies follow no server hint.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "default" | "sluice" => Some(Self::default()),
            "seed-000" | "seed-001" => Some(Self {
                attempts: 2,
                delay: Duration::from_secs(2),
                factor: 1.0,
                max_delay: Duration::from_secs(2),
                jitter: 0.0,
                on: vec![RetryOn::Connect, RetryOn::Timeout],
                hints: false,
            }),
            "seed-002" => Some(Self {
                attempts: 4,
                delay: Duration::from_secs(1),
                factor: 2.0,
                max_delay: Duration::from_secs(4),
                jitter: 0.0,
                on: vec![
                    RetryOn::Connect,
                    RetryOn::Timeout,
                    RetryOn::Status(502),
                    RetryOn::Status(503),
                    RetryOn::Status(504),
                ],
                hints: false,
            }),
            _ => None,
        }
    }

    /// The preset names.
    pub fn presets() -> impl Iterator<Item = &'static str> {
        PRESETS.into_iter()
    }

    /// This policy changed by `text` (see the module's documentation): a preset named first
    /// replaces it, then each setting replaces one value. The result is checked as a whole.
    pub fn with(&self, text: &str) -> Result<Self, RetrySpecError> {
        let mut policy = self.clone();
        for (i, item) in text.split(',').map(str::trim).enumerate() {
            if item.is_empty() {
                continue;
            }
            let Some((key, value)) = item.split_once('=') else {
                match Self::preset(item) {
                    Some(p) if i == 0 => {
                        policy = p;
                        continue;
                    }
                    Some(_) => return Err(RetrySpecError::PresetNotFirst(item.to_owned())),
                    None => return Err(RetrySpecError::UnknownPreset(item.to_owned())),
                }
            };
            let (key, value) = (key.trim(), value.trim());
            let bad = |problem| RetrySpecError::BadValue {
                key: key.to_owned(),
                value: value.to_owned(),
                problem,
            };
            match key {
                "attempts" => {
                    policy.attempts = value.parse().map_err(|_| bad(ValueProblem::NotWhole))?;
                }
                "delay" => policy.delay = duration(value).map_err(bad)?,
                "max-delay" => policy.max_delay = duration(value).map_err(bad)?,
                "factor" => {
                    policy.factor = value.parse().map_err(|_| bad(ValueProblem::NotANumber))?;
                }
                "jitter" => {
                    policy.jitter = value.parse().map_err(|_| bad(ValueProblem::NotANumber))?;
                }
                "hints" => {
                    policy.hints = match value {
                        "true" => true,
                        "false" => false,
                        _ => return Err(bad(ValueProblem::NotABool)),
                    };
                }
                "on" => {
                    policy.on = value
                        .split('+')
                        .map(str::trim)
                        .filter(|w| !w.is_empty() && *w != "none")
                        .map(RetryOn::parse)
                        .collect::<Result<_, _>>()
                        .map_err(bad)?;
                }
                _ => return Err(RetrySpecError::UnknownSetting(key.to_owned())),
            }
        }
        policy.check()?;
        Ok(policy)
    }

    /// Reads `text` applied to the default policy.
    pub fn parse(text: &str) -> Result<Self, RetrySpecError> {
        Self::default().with(text)
    }

    fn check(&self) -> Result<(), RetrySpecError> {
        if !(1..=MAX_ATTEMPTS).contains(&self.attempts) {
            return Err(RetrySpecError::Attempts(self.attempts));
        }
        if self.delay > MAX_DELAY || self.max_delay > MAX_DELAY {
            return Err(RetrySpecError::Delay);
        }
        if !(1.0..=10.0).contains(&self.factor) {
            return Err(RetrySpecError::Factor(self.factor));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(RetrySpecError::Jitter(self.jitter));
        }
        Ok(())
    }

    /// The computed delay before retry number `retry` (0-based), before jitter:
    /// `delay × factor^retry`, capped at `max_delay`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let exp = i32::try_from(retry).unwrap_or(i32::MAX);
        let secs = self.delay.as_secs_f64() * self.factor.powi(exp);
        // Also caps an overflowing power (infinity) before it reaches Duration.
        Duration::from_secs_f64(secs.min(self.max_delay.as_secs_f64()))
    }

    /// Whether a failure is retried: `connect` and `timeout` name the transport failures,
    /// `status` is the HTTP status the provider answered with (429 for a throttling however
    /// it came).
    pub fn retries(&self, connect: bool, timeout: bool, status: Option<u16>) -> bool {
        self.on.iter().any(|on| match *on {
            RetryOn::Connect => connect,
            RetryOn::Timeout => timeout,
            RetryOn::Status(code) => status == Some(code),
            RetryOn::Class(c) => status.is_some_and(|s| s / 100 == u16::from(c)),
        })
    }
}

impl fmt::Display for RetryPolicy {
    /// The policy as settings that [`RetryPolicy::parse`] reads back to the same policy.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on: Vec<String> = self.on.iter().map(ToString::to_string).collect();
        write!(
            f,
            "attempts={},delay={}ms,factor={},max-delay={}ms,jitter={},on={},hints={}",
            self.attempts,
            self.delay.as_millis(),
            self.factor,
            self.max_delay.as_millis(),
            self.jitter,
            if on.is_empty() {
                "none".to_owned()
            } else {
                on.join("+")
            },
            self.hints
        )
    }
}

/// A duration written as `250ms`, `2s` or `1.5s`.
fn duration(text: &str) -> Result<Duration, ValueProblem> {
    let (number, unit) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(ValueProblem::NoUnit);
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| ValueProblem::NotADuration)?;
    let secs = value * unit;
    if !secs.is_finite() || secs < 0.0 || secs > MAX_DELAY.as_secs_f64() {
        return Err(ValueProblem::DurationRange);
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn presets_hold_the_specs_policies() {
        let seed0 = RetryPolicy::preset("seed-000").unwrap();
        assert_eq!(RetryPolicy::preset("seed-001"), Some(seed0.clone()));
        assert_eq!(seed0.attempts, 2);
        assert_eq!(seed0.backoff(0), Duration::from_secs(2));
        assert!(seed0.retries(true, false, None) && seed0.retries(false, true, None));
        for status in [401, 429, 500, 503] {
            assert!(
                !seed0.retries(false, false, Some(status)),
                "{status} is final"
            );
        }
        let seed2 = RetryPolicy::preset("seed-002").unwrap();
        let delays: Vec<_> = (0..3).map(|n| seed2.backoff(n)).collect();
        assert_eq!(delays, [1, 2, 4].map(Duration::from_secs));
        assert_eq!(seed2.attempts, 4);
        for status in [502, 503, 504] {
            assert!(seed2.retries(false, false, Some(status)));
        }
        assert!(!seed2.retries(false, false, Some(500)));
        assert!(!seed2.retries(false, false, Some(429)));
        let default = RetryPolicy::default();
        for status in [408, 409, 429, 500, 529] {
            assert!(default.retries(false, false, Some(status)), "{status}");
        }
        assert!(!default.retries(false, false, Some(400)));
        assert_eq!(RetryPolicy::preset("sluice"), Some(default));
    }

    #[test]
    fn settings_apply_over_the_policy_in_force_or_a_preset_named_first() {
        let base = RetryPolicy::preset("seed-002").unwrap();
        let fewer = base.with("attempts=3").unwrap();
        assert_eq!(fewer.attempts, 3);
        assert_eq!(fewer.on, base.on, "what is not named is kept");
        let replaced = base.with("seed-000 , delay=250ms").unwrap();
        assert_eq!(replaced.attempts, 2);
        assert_eq!(replaced.delay, Duration::from_millis(250));
        let custom = RetryPolicy::parse(
            "attempts=5,delay=1.5s,factor=3,max-delay=10s,jitter=0,on=connect+503+4xx,hints=false",
        )
        .unwrap();
        assert_eq!(custom.backoff(0), Duration::from_millis(1500));
        assert_eq!(custom.backoff(1), Duration::from_millis(4500));
        assert_eq!(custom.backoff(2), Duration::from_secs(10), "capped");
        assert_eq!(custom.backoff(u32::MAX), Duration::from_secs(10));
        assert!(custom.retries(false, false, Some(404)));
        assert!(!custom.retries(false, true, None));
        assert!(RetryPolicy::parse("on=none").unwrap().on.is_empty());
        assert_eq!(RetryPolicy::parse("").unwrap(), RetryPolicy::default());
    }

    #[test]
    fn a_policy_written_out_reads_back_the_same() {
        for name in RetryPolicy::presets() {
            let p = RetryPolicy::preset(name).unwrap();
            assert_eq!(
                RetryPolicy::parse(&p.to_string()).unwrap(),
                p,
                "{name}: {p}"
            );
        }
        let none = RetryPolicy::parse("on=none,attempts=1").unwrap();
        assert_eq!(RetryPolicy::parse(&none.to_string()).unwrap(), none);
    }

    #[test]
    fn bad_settings_are_refused_with_what_to_write() {
        for (text, says) in [
            ("seed-003", "unknown retry preset"),
            ("attempts=2,seed-002", "must come first"),
            ("attempts=0", "1 to 10"),
            ("attempts=11", "1 to 10"),
            ("attempts=two", "whole number"),
            ("delay=2", "give a unit"),
            ("delay=-1s", "0 to 300"),
            ("delay=301s", "0 to 300"),
            ("max-delay=1h", "give a unit"),
            ("factor=0.5", "factor must be 1 to 10"),
            ("jitter=2", "jitter must be 0 to 1"),
            ("on=connect+teapot", "unknown failure"),
            ("on=200", "unknown failure"),
            ("hints=yes", "true or false"),
            ("retries=2", "unknown retry setting"),
        ] {
            let e = RetryPolicy::parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
