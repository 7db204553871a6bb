//! When and how long to wait before another attempt at a provider call.
//!
//! The providers' own SDKs retry 408, 409, 429, 5xx and connection errors; they wait the
//! server's hint when it is at most 60 s, else 0.5 s × 2^n capped at 8 s with jitter, two
//! retries by default. sluice does the same, and only before the first chunk of a stream has
//! been published: after that a failure is a terminal error. A server's `x-should-retry`
//! header, when present, decides instead of the status ([`should_retry`]).

use std::time::Duration;

use reqwest::header::HeaderMap;

use crate::provider::ProviderError;

/// How many times and how long to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// The first computed delay.
    pub initial: Duration,
    /// The cap on computed delays.
    pub max: Duration,
    /// A server hint longer than this is not waited for; the computed delay is used.
    pub max_hint: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 2,
            initial: Duration::from_millis(500),
            max: Duration::from_secs(8),
            max_hint: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (0-based) after `error`, or `None` when the
    /// error is not retryable or the retries are spent.
    pub fn delay(&self, retry: u32, error: &ProviderError) -> Option<Duration> {
        if retry >= self.max_retries || !error.retryable() {
            return None;
        }
        if let Some(hint) = error.retry_after
            && hint <= self.max_hint
        {
            return Some(hint);
        }
        let exp = self
            .initial
            .saturating_mul(2u32.saturating_pow(retry))
            .min(self.max);
        // Jitter between 75% and 100%, so a fleet of replicas does not retry in lockstep.
        let millis = u64::try_from(exp.as_millis()).unwrap_or(u64::MAX);
        Some(Duration::from_millis(rand::random_range(
            millis * 3 / 4..=millis.max(1),
        )))
    }
}

/// The server's retry hint from `retry-after-ms`, then `retry-after` (seconds or an HTTP
/// date), as OpenAI's and Azure's SDKs read them.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.trim().parse::<f64>().ok())
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = text("retry-after")?.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

/// The server's verdict from `x-should-retry`: `Some(true)` or `Some(false)` for exactly
/// `true` or `false`, as the OpenAI and Anthropic SDKs read it; `None` otherwise.
pub fn should_retry(headers: &HeaderMap) -> Option<bool> {
    match headers.get("x-should-retry")?.to_str().ok()?.trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;
    use crate::provider::FailureKind;

    #[test]
    fn retryable_errors_back_off_exponentially_within_the_cap() {
        let p = RetryPolicy {
            max_retries: 5,
            ..Default::default()
        };
        let e = ProviderError::new(FailureKind::Server, "500");
        let d: Vec<_> = (0..5).map(|n| p.delay(n, &e).unwrap()).collect();
        assert!(d[0] >= Duration::from_millis(375) && d[0] <= Duration::from_millis(500));
        assert!(d[1] >= Duration::from_millis(750) && d[1] <= Duration::from_secs(1));
        assert!(d[4] <= Duration::from_secs(8) && d[4] >= Duration::from_secs(6));
        assert_eq!(p.delay(5, &e), None, "retries spent");
    }

    #[test]
    fn hints_are_honoured_up_to_a_limit_and_final_errors_are_not_retried() {
        let p = RetryPolicy::default();
        let hinted = ProviderError::new(FailureKind::RateLimited, "429")
            .with_retry_after(Some(Duration::from_secs(3)));
        assert_eq!(p.delay(0, &hinted), Some(Duration::from_secs(3)));
        let too_long = hinted
            .clone()
            .with_retry_after(Some(Duration::from_secs(600)));
        assert!(p.delay(0, &too_long).unwrap() <= Duration::from_millis(500));
        for kind in [
            FailureKind::Auth,
            FailureKind::Quota,
            FailureKind::BadRequest,
        ] {
            assert_eq!(p.delay(0, &ProviderError::new(kind, "x")), None);
        }
    }

    #[test]
    fn the_servers_should_retry_header_overrides_the_kind() {
        let p = RetryPolicy::default();
        let mut h = HeaderMap::new();
        assert_eq!(should_retry(&h), None);
        h.insert("x-should-retry", HeaderValue::from_static("maybe"));
        assert_eq!(should_retry(&h), None, "only exactly true or false count");
        h.insert("x-should-retry", HeaderValue::from_static("false"));
        let server = ProviderError::new(FailureKind::Server, "500");
        assert!(p.delay(0, &server).is_some());
        let vetoed = server.with_should_retry(should_retry(&h));
        assert_eq!(p.delay(0, &vetoed), None);
        assert_eq!(vetoed.kind, FailureKind::Server, "the kind is kept");
        h.insert("x-should-retry", HeaderValue::from_static("true"));
        let bad = ProviderError::new(FailureKind::BadRequest, "400");
        assert_eq!(p.delay(0, &bad), None);
        let allowed = bad.with_should_retry(should_retry(&h));
        assert!(p.delay(0, &allowed).is_some());
        assert_eq!(p.delay(2, &allowed), None, "the retry budget still applies");
    }

    #[test]
    fn retry_after_reads_milliseconds_seconds_and_dates() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("150"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(150)));
        let mut d = HeaderMap::new();
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
        d.insert("retry-after", HeaderValue::from_str(&later).unwrap());
        let got = retry_after(&d).unwrap();
        assert!(got > Duration::from_secs(25) && got <= Duration::from_secs(30));
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }
}
