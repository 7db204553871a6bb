//! SigV4 request signing, through `aws-sigv4` (the AWS SDK's own signer) with tracing off.

use std::time::SystemTime;

use reqwest::header::HeaderValue;

use crate::provider::{FailureKind, ProviderError};

/// SigV4 keys, borrowed for one signature.
pub(super) struct SigV4Keys<'a> {
    pub(super) access_key_id: &'a str,
    pub(super) secret_access_key: &'a str,
    pub(super) session_token: Option<&'a str>,
}

/// The headers that sign a request with SigV4: `x-amz-date`, `authorization` and, with a
/// session token, `x-amz-security-token`. `url` must be exactly what is sent (already
/// percent-encoded); `headers` are the other headers to sign, as sent.
#[allow(clippy::too_many_arguments)]
pub(super) fn sigv4_headers(
    keys: &SigV4Keys<'_>,
    region: &str,
    service: &str,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    time: SystemTime,
) -> Result<Vec<(&'static str, HeaderValue)>, ProviderError> {
    use aws_sigv4::{
        http_request::{SignableBody, SignableRequest, SigningSettings, sign},
        sign::v4,
    };
    // Errors from the signer describe the URL or a header name, never a key; still, only
    // their kind is passed on.
    let failed = |what: &str| {
        ProviderError::new(
            FailureKind::BadRequest,
            format!("cannot sign the bedrock request: {what}"),
        )
    };
    let identity = aws_credential_types::Credentials::new(
        keys.access_key_id,
        keys.secret_access_key,
        keys.session_token.map(str::to_owned),
        None,
        "sluice",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|_| failed("incomplete signing parameters"))?
        .into();
    let request = SignableRequest::new(
        method,
        url,
        headers.iter().copied(),
        SignableBody::Bytes(body),
    )
    .map_err(|_| failed("the URL or a header cannot be signed"))?;
    // aws-sigv4 traces the canonical request, session token included: no subscriber may
    // see it, whatever RUST_LOG says.
    let signed =
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::new(), || {
            sign(request, &params)
        })
        .map_err(|_| failed("the signer refused the request"))?;
    let (instructions, _signature) = signed.into_parts();
    let (signed_headers, _params) = instructions.into_parts();
    signed_headers
        .into_iter()
        .map(|h| {
            HeaderValue::from_str(h.value())
                .map(|v| (h.name(), v))
                .map_err(|_| failed("a signed header is not a valid header value"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's SigV4 test suite, `post-vanilla` and `get-vanilla-with-session-token`
    /// (credentials AKIDEXAMPLE, 2015-08-30T12:36:00Z, us-east-1, service `service`).
    #[test]
    fn signatures_match_the_aws_sigv4_test_suite() {
        let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_440_938_160);
        let mut keys = SigV4Keys {
            access_key_id: "AKIDEXAMPLE",
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            session_token: None,
        };
        let auth = |keys: &SigV4Keys<'_>, method| {
            let h = sigv4_headers(
                keys,
                "us-east-1",
                "service",
                method,
                "https://example.amazonaws.com/",
                &[],
                b"",
                time,
            )
            .unwrap();
            let get = |n: &str| {
                h.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_str().unwrap().to_owned())
            };
            assert_eq!(get("x-amz-date").as_deref(), Some("20150830T123600Z"));
            (get("authorization").unwrap(), get("x-amz-security-token"))
        };
        assert_eq!(
            auth(&keys, "POST").0,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
        );
        let token = "6e86291e8372ff2a2260956d9b8aae1d763fbf315fa00fa31553b73ebf194267";
        keys.session_token = Some(token);
        let (authorization, sent_token) = auth(&keys, "GET");
        assert_eq!(
            authorization,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date;x-amz-security-token, \
             Signature=07ec1639c89043aa0e3e2de82b96708f198cceab042d4a97044c66dd9f74e7f8"
        );
        assert_eq!(sent_token.as_deref(), Some(token));
    }
}
