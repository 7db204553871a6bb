//! When and how long to wait before another attempt at a provider call.
//!
//! The policy ([`RetryPolicy`], from sluice-schema) is the processor's own (`--retry`), or a
//! request's `retry` line applied over it. By default sluice does what the providers' SDKs
//! do: 408, 409, 429, 5xx and connection errors retried, the server's hint waited when it is
//! at most 60 s, else 0.5 s × 2^n capped at 8 s with jitter, two retries. Retries happen
//! only before the first chunk of a stream has been published: after that a failure is a
//! terminal error. With hints followed, a server's `x-should-retry` header decides instead
//! of the status ([`should_retry`]).

use std::time::Duration;

use reqwest::header::HeaderMap;
pub use sluice_schema::{RetryOn, RetryPolicy};

use crate::provider::{FailureKind, ProviderError};

/// A server hint longer than this is not waited for; the computed delay is used.
pub const MAX_HINT: Duration = Duration::from_secs(60);

/// Whether `policy` retries `error` at all (whatever the attempts left): the server's
/// verdict when the policy follows hints and it gave one, else the policy's list of
/// failures. Running out of quota or credit is never retried: no wait brings credit back.
pub fn retries(policy: &RetryPolicy, error: &ProviderError) -> bool {
    if policy.hints
        && let Some(verdict) = error.should_retry
    {
        return verdict;
    }
    let status = match error.kind {
        FailureKind::Quota => return false,
        // A throttling is a 429 whatever it came with (Bedrock's ThrottlingException is a 400
        // or arrives inside the stream).
        FailureKind::RateLimited => Some(429),
        _ => error.status,
    };
    policy.retries(
        error.kind == FailureKind::Connect,
        error.kind == FailureKind::Timeout,
        status,
    )
}

/// The wait before retry number `retry` (0-based) after `error`, or `None` when `policy`
/// does not retry the error or its attempts are spent.
pub fn delay(policy: &RetryPolicy, retry: u32, error: &ProviderError) -> Option<Duration> {
    if retry.saturating_add(1) >= policy.attempts || !retries(policy, error) {
        return None;
    }
    if policy.hints
        && let Some(hint) = error.retry_after
        && hint <= MAX_HINT
    {
        return Some(hint);
    }
    let computed = policy.backoff(retry);
    if policy.jitter <= 0.0 {
        return Some(computed);
    }
    let low = computed.mul_f64(1.0 - policy.jitter);
    Some(Duration::from_secs_f64(rand::random_range(
        low.as_secs_f64()..=computed.as_secs_f64(),
    )))
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

    fn http(kind: FailureKind, status: u16) -> ProviderError {
        ProviderError::new(kind, status.to_string()).with_status(Some(status))
    }

    #[test]
    fn retryable_errors_back_off_exponentially_within_the_cap() {
        let p = RetryPolicy::parse("attempts=6").unwrap();
        let e = http(FailureKind::Server, 500);
        let d: Vec<_> = (0..5).map(|n| delay(&p, n, &e).unwrap()).collect();
        assert!(d[0] >= Duration::from_millis(375) && d[0] <= Duration::from_millis(500));
        assert!(d[1] >= Duration::from_millis(750) && d[1] <= Duration::from_secs(1));
        assert!(d[4] <= Duration::from_secs(8) && d[4] >= Duration::from_secs(6));
        assert_eq!(delay(&p, 5, &e), None, "attempts spent");
        let exact = RetryPolicy::parse("seed-002").unwrap();
        let d: Vec<_> = (0..3)
            .map(|n| delay(&exact, n, &e.clone().with_status(Some(503))).unwrap())
            .collect();
        assert_eq!(
            d,
            [1, 2, 4].map(Duration::from_secs),
            "no jitter asked, none added"
        );
        assert_eq!(delay(&exact, 3, &http(FailureKind::Server, 503)), None);
    }

    #[test]
    fn hints_are_honoured_up_to_a_limit_and_final_errors_are_not_retried() {
        let p = RetryPolicy::default();
        let hinted =
            http(FailureKind::RateLimited, 429).with_retry_after(Some(Duration::from_secs(3)));
        assert_eq!(delay(&p, 0, &hinted), Some(Duration::from_secs(3)));
        let too_long = hinted
            .clone()
            .with_retry_after(Some(Duration::from_secs(600)));
        assert!(delay(&p, 0, &too_long).unwrap() <= Duration::from_millis(500));
        for (kind, status) in [
            (FailureKind::Auth, 401),
            (FailureKind::Permission, 403),
            (FailureKind::Quota, 429),
            (FailureKind::BadRequest, 400),
        ] {
            assert_eq!(delay(&p, 0, &http(kind, status)), None, "{status}");
        }
        let truncated = ProviderError::new(FailureKind::Truncated, "cut");
        assert_eq!(delay(&p, 0, &truncated), None);
        // A policy that does not follow hints waits its own delay.
        let seed = RetryPolicy::parse("seed-002,on=429").unwrap();
        assert_eq!(delay(&seed, 0, &hinted), Some(Duration::from_secs(1)));
    }

    #[test]
    fn the_policy_names_the_failures_it_retries() {
        let seed0 = RetryPolicy::preset("seed-000").unwrap();
        let refused = ProviderError::new(FailureKind::Connect, "refused");
        let stalled = ProviderError::new(FailureKind::Timeout, "no first token");
        assert_eq!(delay(&seed0, 0, &refused), Some(Duration::from_secs(2)));
        assert_eq!(delay(&seed0, 0, &stalled), Some(Duration::from_secs(2)));
        assert_eq!(delay(&seed0, 1, &stalled), None, "once only");
        for status in [401, 429, 500, 503] {
            let kind =
                crate::providers::classify_status(reqwest::StatusCode::from_u16(status).unwrap());
            assert_eq!(
                delay(&seed0, 0, &http(kind, status)),
                None,
                "{status} is final"
            );
        }
        let seed2 = RetryPolicy::preset("seed-002").unwrap();
        assert!(delay(&seed2, 0, &http(FailureKind::Server, 502)).is_some());
        assert_eq!(delay(&seed2, 0, &http(FailureKind::Server, 500)), None);
        // A throttling is a 429 whatever status it came with (Bedrock answers 400).
        let throttled = ProviderError::new(FailureKind::RateLimited, "slow down");
        assert!(delay(&RetryPolicy::default(), 0, &throttled).is_some());
        assert_eq!(delay(&seed2, 0, &throttled), None);
        let none = RetryPolicy::parse("on=none").unwrap();
        assert_eq!(delay(&none, 0, &refused), None);
    }

    #[test]
    fn the_servers_should_retry_header_overrides_the_list_when_hints_are_followed() {
        let p = RetryPolicy::default();
        let mut h = HeaderMap::new();
        assert_eq!(should_retry(&h), None);
        h.insert("x-should-retry", HeaderValue::from_static("maybe"));
        assert_eq!(should_retry(&h), None, "only exactly true or false count");
        h.insert("x-should-retry", HeaderValue::from_static("false"));
        let server = http(FailureKind::Server, 500);
        assert!(delay(&p, 0, &server).is_some());
        let vetoed = server.with_should_retry(should_retry(&h));
        assert_eq!(delay(&p, 0, &vetoed), None);
        assert_eq!(vetoed.kind, FailureKind::Server, "the kind is kept");
        h.insert("x-should-retry", HeaderValue::from_static("true"));
        let bad = http(FailureKind::BadRequest, 400);
        assert_eq!(delay(&p, 0, &bad), None);
        let allowed = bad.with_should_retry(should_retry(&h));
        assert!(delay(&p, 0, &allowed).is_some());
        assert_eq!(delay(&p, 2, &allowed), None, "the attempts still apply");
        let deaf = RetryPolicy::parse("hints=false").unwrap();
        assert_eq!(
            delay(&deaf, 0, &allowed),
            None,
            "hints not followed: 400 is final"
        );
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
